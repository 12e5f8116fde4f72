#!/usr/bin/env python3
"""Ready-made Dataflow worker settings (templates/settings/*.flags): the one source that the launch scripts, the
README commands and the CI checks all read.

A settings file is a list of Beam pipeline options, one `--name=value` per line; `#` starts a comment. `${IMAGE}`
stands for the worker container image, `${PROJECT}` and `${ZONE}` for the project and the worker zone; all are
filled in from the command line. The same file becomes:

- Beam arguments for a direct launch (`python -m pipeline.run --runner=DataflowRunner ...`) and for the CI dry run
  (`--format=beam`);
- `gcloud dataflow flex-template run` flags for a Flex Template launch (`--format=gcloud`): the options that gcloud
  has its own flag for go there (machine type, worker counts, zone; service options through
  `--additional-experiments`, the documented way for Flex Templates), every other one goes through `--parameters`
  and is therefore declared in templates/metadata.json (CI checks that);
- the image variant the settings need, `tpu` or `gpu` (`--format=variant`), read from the accelerator type;
- the template spec that templates/build.sh wrote for an image (`--format=template --bucket BUCKET`).

Images are referenced by the unique tag that templates/build.sh gives each build (`IMAGE:tpu-20260101-120000`) or
by digest (`IMAGE@sha256:...`), never by a tag that a later build moves (`:tpu`, `:gpu`, `:latest`).

Standard library only, so the scripts can run it with any Python 3.8+ (no project virtualenv needed):

    python3 templates/settings.py --list
    python3 templates/settings.py gpu-l4 --image us-docker.pkg.dev/my-project/flux2/flux2-klein:gpu-20260101-120000
    python3 templates/settings.py tpu-v6e --image IMAGE --project PROJECT --zone ZONE --format gcloud --use-reservation

Each output argument is printed on its own line (values may contain `;`, never a newline).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

SETTINGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "settings")
SUFFIX = ".flags"
IMAGE_PLACEHOLDER = "${IMAGE}"
# Placeholder -> the command-line option that fills it in.
PLACEHOLDERS = {IMAGE_PLACEHOLDER: "--image", "${PROJECT}": "--project",
                "${ZONE}": "--zone (templates/run.sh: --worker-zone=ZONE after --)"}
# Tags that a later build moves: a job must name the image of one build (build.sh's unique tag, or a digest).
MUTABLE_TAGS = frozenset({"latest", "tpu", "gpu"})
ACCELERATOR_OPTION = "worker_accelerator="
RESERVATION_OPTION = "automatically_use_created_reservation"  # Dataflow: consume matching Compute Engine reservations

# Options that appear once per file at most (Beam lets `experiments` and `dataflow_service_options` repeat).
REPEATABLE = frozenset({"experiments", "dataflow_service_options"})

# Every settings file must say all of these: what the CI checks assert and what the README promises.
REQUIRED = (
    "machine_type",
    "dataflow_service_options",
    "number_of_worker_harness_threads",
    "disk_size_gb",
    "max_num_workers",
    "sdk_container_image",
    "sdk_location",
    "require_accelerator",
)

# Settings option -> the `gcloud dataflow flex-template run` flag that carries it. Everything else is passed as a
# template parameter (`--parameters name=value`) and must be declared in metadata.json.
GCLOUD_FLAGS = {
    "machine_type": "--worker-machine-type",
    "max_num_workers": "--max-workers",
    "num_workers": "--num-workers",
    "worker_zone": "--worker-zone",
}
# Options that a Flex Template launch passes as one gcloud list flag. The Dataflow service-options page: "If you're
# using Flex Templates, use the gcloud dataflow flex-template run command" with --additional-experiments.
GCLOUD_LIST_FLAGS = {"dataflow_service_options": "--additional-experiments"}



def _tpu_catalogue():
    """model/preflight/tpu_catalogue.py, loaded by its path (standard library only): this script runs from a
    checkout with any python3, without the package installed."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "model", "preflight",
                        "tpu_catalogue.py")
    spec = importlib.util.spec_from_file_location("flux2_tpu_catalogue", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up while the file runs
    spec.loader.exec_module(module)
    return module


_TPUS = _tpu_catalogue()
# Dataflow TPU types -> {topology: the machine type Dataflow requires} (Dataflow TPU docs; a mismatch is rejected
# at submission with "The requested accelerator type ... requires setting the worker machine type to ...").
TPU_MACHINE_TYPES = _TPUS.MACHINE_TYPES
# Dataflow TPU types -> the TPU_ACCELERATOR_TYPE name of the TPU runtime (v5litepod-1, v6e-4, ...: version and chip
# count), as Dataflow's TPU troubleshooting page sets it for custom images.
TPU_RUNTIME_NAMES = _TPUS.RUNTIME_NAMES
# TPU types whose VMs take only Hyperdisk (Cloud TPU "Attach durable block storage": v6e supports Hyperdisk Balanced
# and Hyperdisk ML), so their settings must name the disk type.
HYPERDISK_ONLY = {"tpu-v6e-slice": ("hyperdisk-balanced", "hyperdisk-ml")}

# NVIDIA GPU types -> (machine-type prefix it needs, {machine type: GPUs attached}) for the types offered here.
GPU_MACHINE_TYPES = {
    "nvidia-l4": ("g2-", {"g2-standard-4": 1, "g2-standard-8": 1, "g2-standard-12": 1, "g2-standard-16": 1,
                          "g2-standard-32": 1, "g2-standard-24": 2, "g2-standard-48": 4, "g2-standard-96": 8}),
    "nvidia-h100-80gb": ("a3-highgpu-", {"a3-highgpu-1g": 1, "a3-highgpu-2g": 2, "a3-highgpu-4g": 4,
                                         "a3-highgpu-8g": 8}),
}

_LINE = re.compile(r"^--([a-z][a-z0-9_]*)=(.+)$")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_DISK_TYPE = re.compile(r"compute\.googleapis\.com/projects/[^/]+/zones/[^/]+/diskTypes/([a-z0-9-]+)")


def tpu_runtime_env(kind: str, topology: str) -> Dict[str, str]:
    """The TPU runtime's environment for one single-host Dataflow TPU worker of `kind` and `topology` ('2x2'):
    no metadata-server query, one host holding every chip, this host as worker 0."""
    x, y = (int(n) for n in topology.split("x"))
    return {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": f"{TPU_RUNTIME_NAMES[kind]}-{x * y}",
        "TPU_HOST_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_HOST_BOUNDS": f"{x},{y},1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_WORKER_ID": "0",
    }


def parse_env(value: str) -> Dict[str, str]:
    """'A=1;B=2,2,1' -> {'A': '1', 'B': '2,2,1'} (the --worker_env format)."""
    pairs = [entry.partition("=") for entry in value.split(";") if entry]
    bad = [name + sep + rest for name, sep, rest in pairs if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name)]
    if bad:
        raise SettingsError(f"--worker_env entries must be NAME=value, got {bad[0]!r}")
    return {name: rest for name, _, rest in pairs}


def check_image(image: str, variant: Optional[str] = None) -> None:
    """Reject an image reference that a later build could change under a running job: no tag, or `:tpu`/`:gpu`/
    `:latest`; and a build.sh tag of the other variant (`...:gpu-...` for TPU settings)."""
    if not image or "${" in image or any(c.isspace() for c in image):
        raise SettingsError(f"not a container image reference: {image!r}")
    name, at, digest = image.partition("@")
    if at:
        if not _DIGEST.fullmatch(digest):
            raise SettingsError(f"{image!r}: a digest reference must end in @sha256:<64 hex digits>")
        return
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    if not tag or tag in MUTABLE_TAGS:
        raise SettingsError(f"{image!r} names no build: use the unique tag templates/build.sh printed "
                            f"(IMAGE:{variant or 'tpu'}-YYYYMMDD-HHMMSS) or a digest (IMAGE@sha256:...), "
                            f"not {'no tag' if not tag else ':' + tag}, which the next build moves")
    other = {"tpu": "gpu", "gpu": "tpu"}.get(variant or "")
    if other and tag.startswith(other + "-"):
        raise SettingsError(f"{image!r} is a {other} image, but these settings need the {variant} image")


def template_spec_path(bucket: str, image: str) -> str:
    """Where templates/build.sh wrote the Flex Template spec for the build that made `image` (tagged by build.sh)."""
    tag = image.rsplit("/", 1)[-1].partition(":")[2] if "@" not in image else ""
    if not tag:
        raise SettingsError(f"{image!r} has no build tag to find its template spec; pass the spec with --template")
    return f"gs://{bucket.replace('gs://', '').strip('/')}/templates/flux2-klein-{tag}.json"


class SettingsError(ValueError):
    """A settings file that is malformed or contradicts itself; the message names the file and line."""


class WorkerSettings:
    """One parsed settings file. `options` keeps file order; repeatable options keep every value."""

    def __init__(self, name: str, path: str, options: List[Tuple[str, str]], description: str):
        self.name = name
        self.path = path
        self.options = options
        self.description = description

    # -- lookups
    def values(self, key: str) -> List[str]:
        return [v for k, v in self.options if k == key]

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        vals = self.values(key)
        return vals[-1] if vals else default

    def keys(self) -> List[str]:
        seen: List[str] = []
        for k, _ in self.options:
            if k not in seen:
                seen.append(k)
        return seen

    @property
    def accelerator(self) -> Dict[str, str]:
        """The `worker_accelerator=` service option as a dict: {'type': ..., 'count'/'topology': ..., flags: ''}."""
        for value in self.values("dataflow_service_options"):
            if value.startswith("worker_accelerator="):
                return parse_accelerator(value[len("worker_accelerator="):])
        return {}

    @property
    def variant(self) -> str:
        """Which image the settings need: 'tpu' for TPU types, 'gpu' for NVIDIA types."""
        kind = self.accelerator.get("type", "")
        if kind.startswith("tpu-"):
            return "tpu"
        if kind.startswith("nvidia-"):
            return "gpu"
        raise SettingsError(f"{self.path}: no worker_accelerator service option, cannot tell the image variant")

    # -- renderings
    def with_image(self, image: str, project: Optional[str] = None, zone: Optional[str] = None) -> "WorkerSettings":
        """The settings with ${IMAGE} (and, when given, ${PROJECT} and ${ZONE}) filled in."""
        check_image(image, self.variant)
        values = {IMAGE_PLACEHOLDER: image, "${PROJECT}": project, "${ZONE}": zone}
        for placeholder, value in values.items():
            if value is not None and not re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9._:/@]*", value):
                raise SettingsError(f"{PLACEHOLDERS[placeholder].split()[0]}: not a usable value: {value!r}")
        options = []
        for k, v in self.options:
            for placeholder, value in values.items():
                if value is not None:
                    v = v.replace(placeholder, value)
            options.append((k, v))
        return WorkerSettings(self.name, self.path, options, self.description)

    def with_service_options(self, extra: Sequence[str]) -> "WorkerSettings":
        """The settings plus more Dataflow service options (a reservation, ...). The settings' accelerator stays:
        another worker_accelerator is refused (choose other settings instead), so it cannot be dropped or doubled."""
        current = self.values("dataflow_service_options")
        options = list(self.options)
        for option in extra:
            if not re.fullmatch(r"[a-z][a-z0-9_]*(=[^,\s]+)?", option):
                raise SettingsError(f"not a Dataflow service option: {option!r}")
            if option.startswith(ACCELERATOR_OPTION):
                raise SettingsError(f"{self.path} already sets the accelerator "
                                    f"({self.get('dataflow_service_options')}); choose other settings (--list) "
                                    f"instead of adding {option!r}")
            if option not in current:
                current.append(option)
                options.append(("dataflow_service_options", option))
        return WorkerSettings(self.name, self.path, options, self.description)

    def _check_resolved(self) -> None:
        for k, v in self.options:
            for placeholder, flag in PLACEHOLDERS.items():
                if placeholder in v:
                    raise SettingsError(f"{self.path}: --{k} still contains {placeholder}; pass {flag}")

    def beam_args(self) -> List[str]:
        """Beam pipeline arguments, e.g. ['--machine_type=g2-standard-8', ...]."""
        self._check_resolved()
        return [f"--{k}={v}" for k, v in self.options]

    def template_parameters(self) -> List[Tuple[str, str]]:
        """The (name, value) pairs that a Flex Template launch passes with --parameters."""
        return [(k, v) for k, v in self.options if k not in GCLOUD_FLAGS and k not in GCLOUD_LIST_FLAGS]

    def gcloud_args(self) -> List[str]:
        """`gcloud dataflow flex-template run` flags carrying these settings."""
        self._check_resolved()
        args = [f"{GCLOUD_FLAGS[k]}={v}" for k, v in self.options if k in GCLOUD_FLAGS]
        for key, flag in GCLOUD_LIST_FLAGS.items():
            if self.values(key):  # one flag: gcloud list flags take comma-separated values
                args.append(f"{flag}={','.join(self.values(key))}")
        params: Dict[str, List[str]] = {}
        for k, v in self.template_parameters():
            params.setdefault(k, []).append(v)
        for k, vals in params.items():
            # A repeated option (two experiments) travels as one comma-separated value, which Beam splits again.
            args.append(gcloud_parameter(k, ",".join(vals)))
        return args


def gcloud_parameter(name: str, value: str) -> str:
    """One `--parameters` flag. gcloud splits dict flags on ',' unless the value starts with an alternate delimiter
    (`gcloud topic escaping`), so values with commas use `^~^`."""
    if "~" in value and "," in value:
        raise SettingsError(f"--{name}: a value cannot contain both ',' and '~': {value!r}")
    return f"--parameters=^~^{name}={value}" if "," in value else f"--parameters={name}={value}"


def parse_accelerator(spec: str) -> Dict[str, str]:
    """'type:nvidia-l4;count:1;install-nvidia-driver' -> {'type': 'nvidia-l4', 'count': '1',
    'install-nvidia-driver': ''}."""
    out: Dict[str, str] = {}
    for part in spec.split(";"):
        if not part:
            raise SettingsError(f"empty field in worker_accelerator {spec!r}")
        key, _, value = part.partition(":")
        out[key] = value
    return out


def settings_path(name: str) -> str:
    return os.path.join(SETTINGS_DIR, name + SUFFIX)


def available() -> List[str]:
    return sorted(f[: -len(SUFFIX)] for f in os.listdir(SETTINGS_DIR) if f.endswith(SUFFIX))


def parse(text: str, path: str = "<settings>", name: str = "") -> WorkerSettings:
    options: List[Tuple[str, str]] = []
    comments: List[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if not options:
                comments.append(line.lstrip("#").strip())
            continue
        m = _LINE.match(line)
        if not m:
            raise SettingsError(f"{path}:{lineno}: expected --name=value, got {raw!r}")
        key, value = m.group(1), m.group(2)
        if any(c.isspace() for c in value):
            raise SettingsError(f"{path}:{lineno}: --{key} value contains whitespace")
        if key not in REPEATABLE and any(k == key for k, _ in options):
            raise SettingsError(f"{path}:{lineno}: --{key} given twice")
        options.append((key, value))
    settings = WorkerSettings(name, path, options, comments[0] if comments else "")
    validate(settings)
    return settings


def validate(s: WorkerSettings) -> None:
    """Reject settings that Dataflow would reject or that break the project's rules (one SDK process per VM)."""
    missing = [k for k in REQUIRED if s.get(k) is None]
    if missing:
        raise SettingsError(f"{s.path}: missing {', '.join('--' + k for k in missing)}")
    for key in ("number_of_worker_harness_threads", "disk_size_gb", "max_num_workers", "num_workers"):
        value = s.get(key)
        if value is not None and not re.fullmatch(r"[1-9][0-9]*", value):
            raise SettingsError(f"{s.path}: --{key} must be a positive integer, got {value!r}")
    if s.get("sdk_location") != "container":
        raise SettingsError(f"{s.path}: --sdk_location must be 'container' (dependencies are baked into the image)")
    experiments = [e for v in s.values("experiments") for e in v.split(",")]
    if "no_use_multiple_sdk_containers" not in experiments:
        raise SettingsError(f"{s.path}: needs --experiments=no_use_multiple_sdk_containers (one SDK process per VM, "
                            "so one process owns the accelerator)")
    acc = s.accelerator
    machine = s.get("machine_type", "")
    kind = acc.get("type", "")
    if kind in TPU_MACHINE_TYPES:
        topology = acc.get("topology")
        want = TPU_MACHINE_TYPES[kind].get(topology or "")
        if want is None:
            raise SettingsError(f"{s.path}: unknown topology {topology!r} for {kind}")
        if machine != want:
            raise SettingsError(f"{s.path}: {kind} topology {topology} requires --machine_type={want}, "
                                f"got {machine}")
        env = parse_env(s.get("worker_env", ""))
        for name, value in tpu_runtime_env(kind, topology).items():
            if env.get(name) != value:
                raise SettingsError(f"{s.path}: {kind} topology {topology} needs {name}={value} in --worker_env "
                                    f"(the TPU runtime's settings for a custom image), got {env.get(name)!r}")
    elif kind in GPU_MACHINE_TYPES:
        prefix, gpus = GPU_MACHINE_TYPES[kind]
        if not machine.startswith(prefix) or machine not in gpus:
            raise SettingsError(f"{s.path}: {kind} needs a {prefix}* machine type, got {machine}")
        if acc.get("count") != str(gpus[machine]):
            raise SettingsError(f"{s.path}: {machine} has {gpus[machine]} x {kind}, worker_accelerator says "
                                f"count:{acc.get('count')}")
        if "install-nvidia-driver" not in acc:
            raise SettingsError(f"{s.path}: GPU workers need install-nvidia-driver in worker_accelerator")
        tpu_vars = sorted(n for n in parse_env(s.get("worker_env", "")) if n.startswith("TPU_"))
        if tpu_vars:
            raise SettingsError(f"{s.path}: {', '.join(tpu_vars)} in --worker_env of GPU settings")
    else:
        raise SettingsError(f"{s.path}: unsupported or missing worker_accelerator type {kind!r}")
    _validate_disk_type(s, kind)
    if s.get("require_accelerator") != s.variant:
        raise SettingsError(f"{s.path}: --require_accelerator must be {s.variant} for {kind} workers (a worker "
                            f"whose JAX finds no {s.variant} then stops at model load), got "
                            f"{s.get('require_accelerator')!r}")


def _validate_disk_type(s: WorkerSettings, kind: str) -> None:
    """A disk type is a zonal resource: with ${ZONE} the workers must run in that zone; some TPUs need Hyperdisk."""
    disk_type = s.get("disk_type")
    if disk_type is None:
        if kind in HYPERDISK_ONLY:
            raise SettingsError(f"{s.path}: {kind} VMs take only {' or '.join(HYPERDISK_ONLY[kind])} disks; set "
                                f"--disk_type=compute.googleapis.com/projects/${{PROJECT}}/zones/${{ZONE}}/diskTypes/"
                                f"{HYPERDISK_ONLY[kind][0]}")
        return
    m = _DISK_TYPE.fullmatch(disk_type)
    if not m:
        raise SettingsError(f"{s.path}: --disk_type must be compute.googleapis.com/projects/P/zones/Z/diskTypes/T, "
                            f"got {disk_type!r}")
    if kind in HYPERDISK_ONLY and m.group(1) not in HYPERDISK_ONLY[kind]:
        raise SettingsError(f"{s.path}: {kind} VMs take only {' or '.join(HYPERDISK_ONLY[kind])} disks, got "
                            f"{m.group(1)!r}")
    if "${ZONE}" in disk_type and s.get("worker_zone") != "${ZONE}":
        raise SettingsError(f"{s.path}: --disk_type names ${{ZONE}}, so --worker_zone must be ${{ZONE}} too")


def load(name: str, image: Optional[str] = None, project: Optional[str] = None,
         zone: Optional[str] = None) -> WorkerSettings:
    """Read templates/settings/<name>.flags; with `image` (and `project`, `zone`), fill in the placeholders."""
    path = settings_path(name)
    if not os.path.isfile(path):
        raise SettingsError(f"no settings named {name!r}; available: {', '.join(available())}")
    with open(path, encoding="utf-8") as f:
        settings = parse(f.read(), path=path, name=name)
    return settings.with_image(image, project, zone) if image is not None else settings


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="settings name, e.g. tpu-v5e or gpu-l4 (see --list)")
    ap.add_argument("--image", help="worker container image of one build (replaces ${IMAGE})")
    ap.add_argument("--project", help="Google Cloud project (replaces ${PROJECT})")
    ap.add_argument("--zone", help="worker zone (replaces ${ZONE}; the v6e settings need it for their disk type)")
    ap.add_argument("--service-option", action="append", default=[], metavar="OPTION",
                    help="another Dataflow service option for the job (repeatable); the accelerator one stays")
    ap.add_argument("--use-reservation", action="store_true",
                    help=f"consume matching Compute Engine reservations ({RESERVATION_OPTION})")
    ap.add_argument("--bucket", help="with --format=template: the bucket build.sh wrote the template spec to")
    ap.add_argument("--format", choices=("beam", "gcloud", "variant", "describe", "template"), default="beam")
    ap.add_argument("--list", action="store_true", help="list the available settings and exit")
    args = ap.parse_args(argv)
    try:
        if args.list:
            for name in available():
                s = load(name)
                print(f"{name:12s} {s.variant}  {s.get('machine_type')}  {s.description}")
            return 0
        if not args.name:
            ap.error("a settings name is required (see --list)")
        settings = load(args.name, args.image, args.project, args.zone)
        settings = settings.with_service_options(
            args.service_option + ([RESERVATION_OPTION] if args.use_reservation else []))
        if args.format == "variant":
            print(settings.variant)
        elif args.format == "describe":
            print(settings.description)
        elif args.image is None:
            ap.error(f"--format={args.format} needs --image")
        elif args.format == "template":
            if not args.bucket:
                ap.error("--format=template needs --bucket")
            print(template_spec_path(args.bucket, args.image))
        else:
            lines = settings.beam_args() if args.format == "beam" else settings.gcloud_args()
            print("\n".join(lines))
    except SettingsError as e:
        print(f"settings.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
