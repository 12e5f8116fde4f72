"""What a deployment sets when it loads the model: the engine's options and the one load-settings object.

`LoadSettings` goes unchanged from the job's options (pipeline) through the RunInference handler (transforms) to
`model.load`; every value is checked when the object is made, so a bad option fails at launch, not on a worker.
JAX-free, like `model.contract`. How the programs compute on each platform is not an option: model.nets.platform_forms
picks it from the platform.
"""

from __future__ import annotations

import dataclasses
import re

from .contract import DEFAULT_MAX_SEQUENCE_LENGTH, count, is_integer, optional_count

VARIANT_NAME = re.compile(r"[A-Za-z0-9_-]+")  # e.g. fp16, bf16: it goes into file names between dots


def validate_variant(variant, name: str = "variant") -> None:
    """A variant is None or a name that can sit between dots in a file name (fp16, bf16, ...); `name` is what the
    caller calls it in the error (the job: --model_variant)."""
    if variant is not None and (not isinstance(variant, str) or not VARIANT_NAME.fullmatch(variant)):
        raise ValueError(f"{name} must be a weight-file variant name such as 'fp16' (letters, digits, _ and -), "
                         f"got {variant!r}")

from .config.lora_spec import LoraSpec
from .config.score_settings import ScoreSettings

DTYPE_NAMES = ("bfloat16", "float32")
# Weight and activation quantization of the transformer's block projections (model.nets.quantize): none | int8.
QUANTIZE_MODES = ("none", "int8")
PROGRAMS = ("encode", "denoise", "decode")
DEFAULT_TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)
# The compiled batch where nothing names one: without a known TPU topology to check it against, and the most that the
# search for the largest batch that fits a TPU chip tries (model.preflight.aot.fit).
DEFAULT_BATCH_SIZE = 4
DEFAULT_MAX_BATCH_SIZE = 8


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the compiled programs are laid out on the machine: batch, attention kernels, caches, parallelism."""

    batch_size: int | None = None      # compiled batch size; None = the number of images asked for
    attention: str = "auto"            # transformer attention: auto | xla | cudnn | blocked | splash
    # text encoder attention (masked): auto = blocked on CPU, xla on GPU, splash on TPU (xla for float32 models)
    text_encoder_attention: str = "auto"
    embed_cache_size: int = 16         # bounded in-process cache of text embeddings (0 or less = off)
    # Chips that hold one copy of the weights between them (tensor parallel, model.parallel.sharding): the local devices
    # form a (data, model) mesh of len(devices) / model_shards data replicas, which split the batch. 1 = every chip
    # holds all the weights.
    model_shards: int = 1
    # Which JAX backend's devices run the programs ("tpu", "gpu", "cpu"); None = JAX's default backend. Lets one
    # process compare the same checkpoint on a TPU and on its host's CPU (tests/tpu).
    platform: str | None = None
    compilation_cache_dir: str | None = None  # persistent XLA cache (local path or gs://)
    # Shape buckets whose compiled programs (and RoPE tables, schedules) a process keeps; beyond it the least recently
    # used is dropped (compiled again, from the persistent cache when set, if it comes back). None = keep all. Each
    # bucket kept holds its three executables in host memory (docs/performance.md).
    max_buckets: int | None = 16
    # "int8": the transformer blocks' projections run W8A8 (int8 weights per output channel, activations per token,
    # int32 accumulation): about half the weight memory; images differ from bf16's pixel by pixel
    # (benchmarks.quality measures by how much on your weights).
    quantize: str = "none"

    def __post_init__(self):
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {self.quantize!r}")
        count("model_shards", self.model_shards)
        optional_count("max_buckets", self.max_buckets)
        if self.batch_size is not None:
            count("batch_size", self.batch_size)
        if not is_integer(self.embed_cache_size):
            raise ValueError(f"embed_cache_size must be an integer (0 or less = off), got {self.embed_cache_size!r}")


@dataclasses.dataclass(frozen=True)
class LoadSettings:
    """Everything `model.load` needs: where the checkpoint is, which files and dtype, and the engine's options."""

    model: str
    dtype: str = "bfloat16"
    variant: str | None = None         # weight-file variant (diffusers' variant=, e.g. fp16); None = default files
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    text_encoder_out_layers: tuple[int, ...] = DEFAULT_TEXT_ENCODER_OUT_LAYERS
    cache_dir: str | None = None       # local cache for copies of gs:// checkpoints
    engine: EngineOptions = EngineOptions()
    loras: tuple = ()                  # LoRA adapters merged into the transformer (model.config.lora_spec.LoraSpec)
    lora_per_record: bool = False      # the adapters applied unmerged instead, each call naming one (or none)
    vae: str | None = None             # another VAE in place of the checkpoint's (model/loading/vae_swap.py)
    scores: ScoreSettings | None = None  # score each image with CLIP on the device (model.engine.scoring); None: off

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        validate_variant(self.variant)
        count("max_sequence_length", self.max_sequence_length)
        object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "text_encoder_out_layers", tuple(int(k) for k in self.text_encoder_out_layers))
        object.__setattr__(self, "loras", tuple(s if isinstance(s, LoraSpec) else LoraSpec.parse(s)
                                                for s in self.loras))

    @classmethod
    def create(cls, model: str, dtype: str = "bfloat16", *, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
               batch_size: int | None = None, text_encoder_out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS,
               options: EngineOptions | None = None, cache_dir: str | None = None, variant: str | None = None,
               loras=(), lora_per_record: bool = False, vae: str | None = None,
               **engine_overrides) -> "LoadSettings":
        """Settings from `model.load`'s keyword arguments: `batch_size` and any EngineOptions field override
        `options`."""
        if batch_size is not None:
            engine_overrides["batch_size"] = batch_size
        engine = dataclasses.replace(options or EngineOptions(), **engine_overrides)
        return cls(model=model, dtype=dtype, variant=variant, max_sequence_length=max_sequence_length,
                   text_encoder_out_layers=text_encoder_out_layers, cache_dir=cache_dir, engine=engine,
                   loras=tuple(loras), lora_per_record=bool(lora_per_record), vae=vae)
