"""The job's options as typed, checked groups: one frozen spec a group of the option table (pipeline/option_specs.py
GROUPS): input, output, model, generation, limits, reliability.

`job_spec(options, runner)` takes the parsed options (Beam's `Flux2KleinOptions` view, or any object with the
options as attributes) and the runner they launch on, and returns a `JobSpec`, or raises a UsageError naming the
option. A group's fields are its options, by name (tests keep them in step with the table); a value that is one of
a set is an enum. Here the options' own checks, the checks of options against each other, and the defaults that
depend on the run (the demo's prompts, size and dtype; the output folder; the reference roots) are applied; what
needs the machine or storage (the checkpoint, the input files, the output folder) is pipeline/probes.py's, and
what depends on the checkpoint's configs is applied once they are read (`JobSpec.request_defaults`).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from model import (DEFAULT_BATCH_SIZE, DEFAULT_SIZE, DTYPE_NAMES, MIN_REFERENCE_SIDE as MIN_SIDE, QUANTIZE_MODES,
                   EngineOptions, LoadSettings, LoraSpec, ScoreSettings, count, is_integer, optional_count,
                   parse_head, parse_labels, validate_variant, with_revision)
from transforms.defaults import DEFAULT_NEAR_DUPLICATE_DISTANCE
from transforms.duplicates import check_distance
from transforms.inputs.bigquery import BigQueryInput, is_table_uri, table_spec
from transforms.inputs.columns import ColumnMap, parse_column_map
from transforms.inputs.validation import RequestDefaults
from transforms.layout import IMAGE_FORMATS
from transforms.sinks.encoding import ImageEncoding
from transforms.sinks.registry import OUTPUT_FORMATS
from transforms.preview import check_preview
from transforms.references import default_roots, normalise_root
from transforms.score_filters import check_rules, parse_rules
from transforms.shards import check_samples_per_shard

from .compile_cache import resolve_compilation_cache
from .demo import DEMO_DTYPE, DEMO_PROMPTS, DEMO_SIZE
from .errors import UsageError
from .option_specs import ACCELERATORS, AUTO_BATCH, DEFAULT_OUTPUT, GROUPS, INPUT_FORMATS, OPTIONS


def _choices(name: str, values: tuple[str, ...]) -> type[enum.StrEnum]:
    """An enum of an option's choices, from the tuple that owns them (its members compare equal to the strings)."""
    return enum.StrEnum(name, [(value.upper(), value) for value in values], module=__name__)


InputFormat = _choices("InputFormat", INPUT_FORMATS)  # --input_format
ImageFormat = _choices("ImageFormat", IMAGE_FORMATS)  # --image_format
OutputFormat = _choices("OutputFormat", OUTPUT_FORMATS)  # --output_format
Dtype = _choices("Dtype", DTYPE_NAMES)  # --dtype
Quantize = _choices("Quantize", QUANTIZE_MODES)  # --quantize
Accelerator = _choices("Accelerator", ACCELERATORS)  # --require_accelerator


class ExistingResults(enum.StrEnum):
    """What a run does with a previous run's results in its output (pipeline/output_check.py)."""

    STOP = "stop"  # neither switch: the launch stops when there are any
    SKIP = "skip"  # --skip_existing: keep them, generate only what is missing
    OVERWRITE = "overwrite"  # --overwrite: generate everything again and replace them


# Options whose default depends on the checkpoint, applied when they are not given: (default, the demo's).
CHECKPOINT_DEFAULTS = {"height": (DEFAULT_SIZE, DEMO_SIZE), "width": (DEFAULT_SIZE, DEMO_SIZE),
                       "dtype": (LoadSettings.dtype, DEMO_DTYPE)}
# Pattern characters of Beam's file matching (fnmatch / glob), which an output path cannot hold.
GLOB_CHARACTERS = ("*", "?", "[", "]")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def _set(spec, **values) -> None:
    """Store normalised values on a frozen spec (from its __post_init__)."""
    for name, value in values.items():
        object.__setattr__(spec, name, value)


def _at_least(option: str, value, low: int, note: str = "") -> None:
    if value is None or value < low:
        raise ValueError(f"--{option} must be >= {low}{note}, got {value}")


def input_list(values) -> tuple[str, ...]:
    """--input as a flat tuple: repeated flags and comma-separated values both work."""
    if isinstance(values, str):
        values = [values]
    return tuple(p.strip() for value in values or () for p in str(value).split(",") if p.strip())


def parse_worker_env(text: str | None) -> tuple[tuple[str, str], ...]:
    """--worker_env as (NAME, value) pairs; ValueError naming the entry that is not a new NAME=value."""
    env: dict[str, str] = {}
    for entry in filter(None, (text or "").split(";")):
        name, sep, value = entry.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name) or name in env:
            raise ValueError(f"--worker_env entry {entry!r} is not a new NAME=value pair (NAME in capitals, "
                             f"digits and '_'; pairs separated by ';')")
        env[name] = value
    return tuple(env.items())


def reference_root_list(values) -> tuple[str, ...]:
    """--reference_root (repeated or comma-separated), each normalised (transforms/references.py); () for none."""
    if isinstance(values, str):
        values = [values]
    entries = [e for value in values or () for e in str(value).split(",")]
    return tuple(dict.fromkeys(normalise_root(e) for e in entries))


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """Where the prompt records come from and how their columns are read."""

    input: tuple[str, ...]  # file patterns and bq:// tables, in order (the demo's prompts for the demo)
    input_format: InputFormat
    prompt_column: str
    id_column: str
    column_map: str | None
    max_metadata_bytes: int
    input_query: str | None
    bigquery_temp_dataset: str | None
    columns: ColumnMap = dataclasses.field(init=False)  # the three column options, checked together

    def __post_init__(self):
        _set(self, input=input_list(self.input), input_format=InputFormat(self.input_format),
             columns=ColumnMap(prompt_column=self.prompt_column, id_column=self.id_column,
                               renames=parse_column_map(self.column_map)).validate())
        if not is_integer(self.max_metadata_bytes) or self.max_metadata_bytes < 0:
            raise ValueError(f"--max_metadata_bytes must be an integer >= 0, got {self.max_metadata_bytes!r}")
        for uri in self.tables:
            table_spec(uri)
        if self.input_query is not None and not self.input_query.strip():
            raise ValueError("--input_query is empty")

    @property
    def files(self) -> tuple[str, ...]:
        """The file patterns of --input."""
        return tuple(p for p in self.input if not is_table_uri(p))

    @property
    def tables(self) -> tuple[str, ...]:
        """The BigQuery tables of --input, each once."""
        return tuple(dict.fromkeys(p for p in self.input if is_table_uri(p)))

    @property
    def bigquery(self) -> tuple[BigQueryInput, ...]:
        """The BigQuery reads: each table, then --input_query."""
        query = () if self.input_query is None else (BigQueryInput(query=self.input_query),)
        return tuple(BigQueryInput(uri=uri) for uri in self.tables) + query


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """Where and how the results are written."""

    output: str
    image_format: ImageFormat
    output_format: OutputFormat
    samples_per_shard: int
    preview: int
    png_compress_level: int
    quality: int
    skip_existing: bool
    overwrite: bool
    no_progress: bool
    allow_empty: bool
    near_duplicate_distance: int = DEFAULT_NEAR_DUPLICATE_DISTANCE
    drop_near_duplicates: bool = False
    c2pa_cert: str | None = None
    c2pa_key: str | None = None
    encoding: ImageEncoding = dataclasses.field(init=False)  # the three image options, checked together

    def __post_init__(self):
        if any(c in self.output for c in GLOB_CHARACTERS):
            # Beam's file sinks find their temporary files by pattern: a '[' in the path would make the job fail
            # after every image was written, before the manifest.
            raise ValueError(f"--output={self.output!r} contains a glob character ({', '.join(GLOB_CHARACTERS)}), "
                             f"which Beam's file sinks cannot use in a path; choose another output location")
        _set(self, encoding=ImageEncoding(self.image_format, self.png_compress_level, self.quality))
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output_format={self.output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}")
        check_samples_per_shard(self.samples_per_shard)
        check_preview(self.preview)
        check_distance(self.near_duplicate_distance)
        if bool(self.c2pa_cert) != bool(self.c2pa_key):
            raise ValueError("--c2pa_cert and --c2pa_key go together: give both, or neither")
        if self.skip_existing and self.overwrite:
            raise ValueError("--skip_existing keeps the images already written and --overwrite replaces them; "
                             "give one")
        _set(self, image_format=ImageFormat(self.image_format), output_format=OutputFormat(self.output_format),
             skip_existing=bool(self.skip_existing), overwrite=bool(self.overwrite))

    @property
    def existing(self) -> ExistingResults:
        if self.skip_existing:
            return ExistingResults.SKIP
        return ExistingResults.OVERWRITE if self.overwrite else ExistingResults.STOP


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint, which of its files, and how it is loaded."""

    model: str | None  # as given: a folder, a gs:// prefix or a Hub id (with --model_revision's @rev); None: the demo's
    demo_checkpoint: bool
    model_revision: str | None  # a Hub id's branch, tag or commit, also in `model` as owner/name@rev
    model_variant: str | None
    vae: str | None  # another VAE in place of the checkpoint's (model/loading/vae_swap.py)
    dtype: Dtype
    quantize: Quantize
    max_sequence_length: int
    model_cache: str | None
    lora: tuple = ()  # model.config.lora_spec.LoraSpec, each checked from its header at launch (probes.check_loras)
    lora_per_record: bool = False  # the adapters applied unmerged, each record naming one (or none) in `lora`
    checkpoint_cache_dir: str | None = None

    def __post_init__(self):
        _set(self, model=with_revision(self.model, self.model_revision))
        _set(self, lora=tuple(LoraSpec.parse(text.strip()) for value in self.lora or ()
                              for text in str(value).split(",") if text.strip()))
        validate_variant(self.model_variant, name="--model_variant")
        count("--max_sequence_length", self.max_sequence_length)
        _set(self, dtype=Dtype(self.dtype), quantize=Quantize(self.quantize),
             demo_checkpoint=bool(self.demo_checkpoint))


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """What a record that does not say gets. Checked with the checkpoint's size multiple, once its configs are read
    (`JobSpec.request_defaults`). None steps or guidance: the checkpoint's own."""

    height: int
    width: int
    num_inference_steps: int | None
    guidance_scale: float | None
    num_images: int
    seed: int


@dataclasses.dataclass(frozen=True)
class LimitsSpec:
    """How the work is laid out and what one request or one job may ask for."""

    batch_size: int | str  # AUTO_BATCH: the launch picks it (pipeline/launch_check.py)
    max_batch_size: int
    model_shards: int
    large_model: bool
    model_copies: int | None
    encode_threads: int | None
    compilation_cache_dir: str | None
    max_pixels: int  # checked against the checkpoint's size multiple (JobSpec.request_defaults)
    max_prompt_bytes: int
    max_reference_images: int
    max_reference_pixels: int
    reference_root: tuple[str, ...]  # normalised; (): the folders of the --input files (JobSpec.reference_roots)
    max_images: int | None  # None: no limit

    def __post_init__(self):
        if self.max_images is not None:
            _at_least("max_images", self.max_images, 1)
        optional_count("--model_copies", self.model_copies)
        optional_count("--encode_threads", self.encode_threads)
        if self.batch_size != AUTO_BATCH:
            count("--batch_size", self.batch_size)
        count("--max_batch_size", self.max_batch_size)
        count("--model_shards", self.model_shards)
        count("--max_prompt_bytes", self.max_prompt_bytes)
        count("--max_reference_images", self.max_reference_images)
        smallest = MIN_SIDE * MIN_SIDE
        if not is_integer(self.max_reference_pixels) or self.max_reference_pixels < smallest:
            raise ValueError(f"--max_reference_pixels must be an integer >= {smallest} ({MIN_SIDE} x {MIN_SIDE}), "
                             f"got {self.max_reference_pixels!r}")
        _set(self, reference_root=reference_root_list(self.reference_root), large_model=bool(self.large_model))

    @property
    def auto_batch(self) -> bool:
        """--batch_size auto: the launch picks the batch where it knows the chips, else DEFAULT_BATCH_SIZE (at most
        --max_batch_size)."""
        return self.batch_size == AUTO_BATCH


@dataclasses.dataclass(frozen=True)
class ReliabilitySpec:
    """What happens when a batch fails or a worker is not what the job needs."""

    inference_retries: int
    inference_timeout_s: int  # 0: no limit
    read_timeout_s: int  # each open or read of an input or reference (transforms/bounded_reads.py)
    require_accelerator: Accelerator | None
    skip_preflight: bool
    worker_env: tuple[tuple[str, str], ...]  # (NAME, value) set on each worker before the model loads

    def __post_init__(self):
        _at_least("inference_retries", self.inference_retries, 0)
        _at_least("inference_timeout_s", self.inference_timeout_s, 0, " (0: no limit)")
        _at_least("read_timeout_s", self.read_timeout_s, 1)
        env = self.worker_env
        _set(self, worker_env=parse_worker_env(env) if env is None or isinstance(env, str) else tuple(env),
             require_accelerator=None if self.require_accelerator is None else Accelerator(self.require_accelerator))


# The spec of each group of the option table.
@dataclasses.dataclass(frozen=True)
class ScoresSpec:
    """What each image is scored with on the device, and which scores leave it out of the dataset."""

    score_model: str | None
    score_labels: str | None
    score_heads: tuple[str, ...] | None
    min_score: tuple[str, ...] | None
    max_score: tuple[str, ...] | None
    settings: ScoreSettings | None = dataclasses.field(init=False)  # None: no scoring
    rules: tuple = dataclasses.field(init=False)  # transforms.score_filters.ScoreRule, in the order given

    def __post_init__(self):
        labels = parse_labels(self.score_labels) if self.score_labels else ()
        heads = tuple(parse_head(h) for h in self.score_heads or ())
        rules = parse_rules(self.min_score, self.max_score)
        if self.score_model is None:
            used = [f for f, v in (("--score_labels", labels), ("--score_heads", heads),
                                   ("--min_score", self.min_score), ("--max_score", self.max_score)) if v]
            if used:
                raise ValueError(f"{used[0]} needs --score_model (the CLIP checkpoint that computes the scores)")
            _set(self, settings=None, rules=())
            return
        settings = ScoreSettings(self.score_model, labels=labels, heads=heads)
        check_rules(rules, settings.names)
        _set(self, settings=settings, rules=rules)


SPECS = {"input": InputSpec, "output": OutputSpec, "model": ModelSpec, "generation": GenerationSpec,
         "limits": LimitsSpec, "reliability": ReliabilitySpec, "scores": ScoresSpec}


@dataclasses.dataclass(frozen=True)
class Runner:
    """The Beam runner the job launches on, as the job's checks need it."""

    name: str
    local: bool  # its workers share this machine (and its files)
    temp_location: str | None = None
    project: str | None = None


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The job's options, grouped and checked, and the runner they launch on."""

    input: InputSpec
    output: OutputSpec
    model: ModelSpec
    generation: GenerationSpec
    limits: LimitsSpec
    reliability: ReliabilitySpec
    runner: Runner
    demo: bool = False  # neither --input (nor --input_query) nor --model: the bundled demo
    scores: ScoresSpec | None = None  # --score_model and the filters (None: built without them, as in tests)

    @property
    def tiny(self) -> bool:
        """Whether the demo's checkpoint runs (the demo, or --demo_checkpoint)."""
        return self.demo or self.model.demo_checkpoint

    @property
    def reference_roots(self) -> tuple[str, ...]:
        """Where reference images may be read from: --reference_root, else the folders of the --input files."""
        return self.limits.reference_root or default_roots(self.input.files)

    def request_defaults(self, size_multiple: int, loras=()) -> RequestDefaults:
        """What a record that does not say gets, and the limits it is held to, for a checkpoint of this size
        multiple; UsageError when they could never give a valid request. `loras`: the adapters' identities (name,
        sha256, scale) the launch checked, which records may name with --lora_per_record."""
        g, limits = self.generation, self.limits
        try:
            return RequestDefaults(
                height=g.height, width=g.width, num_inference_steps=g.num_inference_steps,
                guidance_scale=g.guidance_scale, num_images=g.num_images, seed=g.seed, max_pixels=limits.max_pixels,
                max_prompt_bytes=limits.max_prompt_bytes, size_multiple=size_multiple,
                max_metadata_bytes=self.input.max_metadata_bytes, max_reference_images=limits.max_reference_images,
                max_reference_pixels=limits.max_reference_pixels,
                loras=tuple((a["name"], a["sha256"], float(a["scale"])) for a in loras)
                if self.model.lora_per_record else ()).validate()
        except ValueError as e:
            raise UsageError(str(e)) from None

    def load_settings(self, location: str) -> LoadSettings:
        """What every worker hands to model.load: the checkpoint at `location` with the job's dtype, batch, shards,
        quantization and compilation cache."""
        cache = resolve_compilation_cache(self.limits.compilation_cache_dir, local_runner=self.runner.local,
                                          temp_location=self.runner.temp_location)
        limits = self.limits
        # auto: the default (within --max_batch_size) until the launch picks one for the TPU chips
        batch = min(DEFAULT_BATCH_SIZE, limits.max_batch_size) if limits.auto_batch else limits.batch_size
        try:
            return LoadSettings(
                model=location, dtype=str(self.model.dtype), variant=self.model.model_variant,
                max_sequence_length=self.model.max_sequence_length, cache_dir=self.model.checkpoint_cache_dir,
                loras=self.model.lora, lora_per_record=self.model.lora_per_record,
                engine=EngineOptions(batch_size=batch, model_shards=limits.model_shards, compilation_cache_dir=cache,
                                     quantize=str(self.model.quantize)), vae=self.model.vae,
                scores=self.scores.settings if self.scores is not None else None)
        except ValueError as e:
            raise UsageError(str(e)) from None


def _is_demo(values: dict[str, Any], runner: Runner) -> bool:
    """Whether the options ask for the bundled demo; UsageError for a checkpoint or input that is missing or named
    twice, or a demo checkpoint the runner's workers cannot read."""
    model, demo_checkpoint = values["model"], values["demo_checkpoint"]
    if demo_checkpoint and model is not None:
        raise UsageError(f"--demo_checkpoint and --model={model!r} both name the checkpoint; give one")
    if demo_checkpoint and not runner.local:
        raise UsageError(f"--demo_checkpoint is built on this machine, which the workers of {runner.name} cannot "
                         f"read; give --model=gs://... (a copy of a checkpoint)")
    inputs = bool(input_list(values["input"])) or values["input_query"] is not None
    if not inputs and model is None:
        return True
    if not inputs:
        raise UsageError("--input is required with --model (or --input_query; omit --input and --model to run the "
                         "bundled demo)")
    if model is None and not demo_checkpoint:
        raise UsageError("--model is required with --input; to try your input on the bundled tiny random-weight "
                         "checkpoint (noise images), add --demo_checkpoint; omit both --input and --model to run "
                         "the bundled demo")
    return False


def job_spec(options, runner: Runner) -> JobSpec:
    """The options as a JobSpec (the demo's defaults applied); UsageError naming the option for a value or a
    combination the job cannot run."""
    values = {option.name: getattr(options, option.name) for option in OPTIONS}
    demo = _is_demo(values, runner)
    tiny = demo or bool(values["demo_checkpoint"])
    for name, (default, demo_default) in CHECKPOINT_DEFAULTS.items():
        if values[name] is None:
            values[name] = demo_default if tiny else default
    values.update(output=values["output"] or DEFAULT_OUTPUT, input=[DEMO_PROMPTS] if demo else values["input"])
    try:
        groups = {key: SPECS[key](**{o.name: values[o.name] for o in OPTIONS if o.group == key}) for key, _ in GROUPS}
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = JobSpec(**groups, runner=runner, demo=demo)
    if not runner.local and "://" not in spec.output.output:
        raise UsageError(f"--output={spec.output.output!r} is a local path, which the workers of {runner.name} "
                         f"cannot share; give a gs:// location")
    return spec
