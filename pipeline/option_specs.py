"""The job's pipeline options, declared once in `OPTIONS`: how each parses, its group and its one-line description.

Beam-free (so are the modules it takes defaults from): the command line checks its arguments against these options
before importing Beam (pipeline/usage.py), and `Flux2KleinOptions` (pipeline/options.py) declares them to Beam.
`--help` (pipeline/usage.py), the option table of docs/options.md and the Flex Template's metadata.json help texts all
show the description declared here (tests check the last two), so they cannot drift apart. To add an option, add one
`Option(...)` to `OPTIONS` under its group and a field of the same name to that group's spec (pipeline/specs.py),
which is where the job reads it (`JobSpec.<group>.<name>`).

Every option takes `--name=value`, which is how Dataflow Flex Templates pass parameters; the switches
(`--skip_existing`, `--overwrite`, `--large_model`, `--no_progress`) also work bare, and take `=true` / `=false`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from model import (
    DEFAULT_MAX_PIXELS, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_REFERENCE_IMAGES, DEFAULT_MAX_REFERENCE_PIXELS,
    DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_SIZE, DTYPE_NAMES as DTYPES, QUANTIZE_MODES,
)
from model import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_SIZE, DEFAULT_SCORE_MODEL, EngineOptions, LoadSettings
from transforms.defaults import (
    DEFAULT_INFERENCE_RETRIES, DEFAULT_INFERENCE_TIMEOUT_S, DEFAULT_MAX_METADATA_BYTES, DEFAULT_NUM_IMAGES,
    DEFAULT_PREVIEW, DEFAULT_READ_TIMEOUT_S, DEFAULT_SEED,
)
from transforms.defaults import DEFAULT_NEAR_DUPLICATE_DISTANCE
from transforms.inputs.columns import ColumnMap
from transforms.inputs.formats import FORMATS
from transforms.inputs.template import TEMPLATE_FORMAT
from transforms.layout import DEFAULT_PNG_COMPRESS_LEVEL, DEFAULT_QUALITY, IMAGE_FORMATS
from transforms.shards import DEFAULT_SAMPLES_PER_SHARD
from transforms.sinks import registry as sink_registry

from .demo import DEMO_DTYPE, DEMO_SIZE

DEFAULT_OUTPUT = "./output"
# --batch_size: the fastest batch per image up to --max_batch_size that fits the TPU chips (the launch picks)
AUTO_BATCH = "auto"
INPUT_FORMATS = ("auto",) + FORMATS + (TEMPLATE_FORMAT,)  # template: transforms/inputs/template.py
DEFAULT_MAX_IMAGES = 10_000_000
ACCELERATORS = ("tpu", "gpu")  # JAX platform names that --require_accelerator accepts


def str2bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "y", "on"):
        return True
    if text in ("0", "false", "no", "n", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def batch_size_value(value) -> int | str:
    """--batch_size as given: 'auto', or a whole number (the spec checks that it is at least 1); ValueError else."""
    if isinstance(value, int) or str(value).strip().lower() != AUTO_BATCH:
        return int(value)
    return AUTO_BATCH


# The groups of --help and of the option table (docs/options.md), in their order: (key, title).
GROUPS = (
    ("input", "Input"),
    ("output", "Output"),
    ("model", "Model"),
    ("generation", "Generation"),
    ("limits", "Performance and limits"),
    ("reliability", "Reliability"),
    ("scores", "Scores and filters"),
)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of the job: how it parses, where --help lists it, and the one-line description that --help,
    docs/options.md and metadata.json show."""

    name: str  # without the leading --
    group: str  # a key of GROUPS
    help: str  # one line: what the option does (no default: `default` / `shown_default` say it)
    default: Any = None
    type: Callable[[str], Any] | None = None  # argparse type; None: the text as given
    choices: tuple[str, ...] | None = None
    metavar: str = "VALUE"  # the value's placeholder in --help
    shown_default: str | None = None  # the default as --help shows it, when `default` alone would mislead
    switch: bool = False  # true/false; bare `--name` means true
    repeat: bool = False  # may be given more than once; the values are collected in a list

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def default_text(self) -> str:
        """The default as --help and docs/options.md show it."""
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return str(self.default)

    def add_to(self, parser) -> None:
        """Declare the option on an argparse parser or argument group."""
        if self.switch:
            parser.add_argument(self.flag, nargs="?", const=True, default=bool(self.default), type=str2bool,
                                metavar="true|false", help=self.help)
            return
        kwargs: dict[str, Any] = {"default": self.default, "help": self.help}
        if self.repeat:
            kwargs["action"] = "append"
        if self.type is not None:
            kwargs["type"] = self.type
        if self.choices is not None:
            kwargs["choices"] = self.choices
        parser.add_argument(self.flag, metavar=self.metavar if self.choices is None else None, **kwargs)


OPTIONS = (
    # --- input
    Option("input", "input", "Prompt files or globs (gs:// or local; JSONL, CSV, TSV, Parquet or text) or "
                             "bq:// tables; repeat the flag or use commas.",
           repeat=True, metavar="FILES", shown_default="the demo's prompts"),
    Option("input_format", "input", "Format of the input files; auto picks it by extension (.jsonl, .csv, .tsv, "
                                    ".parquet, ...; else text).", default="auto", choices=INPUT_FORMATS),
    Option("prompt_column", "input", "Column (or JSON key) holding the prompt; matched exactly, else ignoring case.",
           default=ColumnMap.prompt_column, metavar="NAME"),
    Option("id_column", "input", "Column (or JSON key) holding the record's id.", default=ColumnMap.id_column,
           metavar="NAME"),
    Option("column_map", "input", "Columns named otherwise, as old=new pairs (new: a generation field such as "
                                  "guidance_scale).", metavar="OLD=NEW,..."),
    Option("max_metadata_bytes", "input", "Largest size of a record's extra columns (manifest 'metadata') as JSON; "
                                          "a larger record is an error row.", type=int,
           default=DEFAULT_MAX_METADATA_BYTES, metavar="BYTES"),
    Option("input_query", "input", "BigQuery standard-SQL query whose rows are prompt records (needs a gs:// "
                                   "--temp_location).", metavar="SQL"),
    Option("bigquery_temp_dataset", "input", "BigQuery dataset (project.dataset) for --input_query's result.",
           metavar="DATASET", shown_default="a temporary one Beam creates"),
    # --- output
    Option("output", "output", "Output folder or gs:// prefix: images/, manifest/, errors/ and summary.json; "
                               "gs:// on Dataflow.", metavar="FOLDER",
           shown_default=f"{DEFAULT_OUTPUT} on local runners"),
    Option("image_format", "output", "Format of the stored images (.png, .webp or .jpg); prompt and parameters go "
                                     "in PNG text or WebP/JPEG EXIF.", default="png",
           choices=IMAGE_FORMATS),
    Option("output_format", "output", sink_registry.description(), default=sink_registry.DEFAULT_OUTPUT_FORMAT,
           choices=sink_registry.OUTPUT_FORMATS),  # one row per sink: transforms/sinks/registry.py
    Option("samples_per_shard", "output", "Images per WebDataset shard (--output_format webdataset).", type=int,
           default=DEFAULT_SAMPLES_PER_SHARD, metavar="N"),
    Option("preview", "output", "Images in the preview gallery (preview/index.html and a contact sheet), the first "
                                "by id; 0: none.", type=int, default=DEFAULT_PREVIEW, metavar="N"),
    Option("png_compress_level", "output", "zlib level of PNG images, 0 (fastest, largest) to 9; 1 encodes faster "
                                           "than 6 for files about 9% larger.", type=int,
           default=DEFAULT_PNG_COMPRESS_LEVEL, metavar="0-9"),
    Option("quality", "output", "Quality of WebP and JPEG images, 1 to 100.", type=int, default=DEFAULT_QUALITY,
           metavar="1-100"),
    Option("skip_existing", "output", "Skip images already written under the output: resume a job.", switch=True,
           default=False),
    Option("overwrite", "output", "Generate every image again into an output that holds a previous run's results, "
                                  "replacing them.", switch=True, default=False),
    Option("no_progress", "output", "Do not print the live progress line (local runners).", switch=True,
           default=False),
    Option("near_duplicate_distance", "output", "Images whose perceptual hashes differ in at most this many of 64 "
                                                "bits are one near-duplicate group (duplicates/).", type=int,
           default=DEFAULT_NEAR_DUPLICATE_DISTANCE, metavar="BITS"),
    Option("drop_near_duplicates", "output", "Keep one image per near-duplicate group (the smallest id) in "
                                             "metadata.jsonl or the shards; mark others duplicate_of.",
           switch=True, default=False),
    Option("c2pa_cert", "output", "PEM certificate chain (leaf first) to sign a C2PA manifest into every image "
                                  "with --c2pa_key (needs the c2pa extra).", metavar="FILE"),
    Option("c2pa_key", "output", "PEM private key of --c2pa_cert.", metavar="FILE"),
    Option("allow_empty", "output", "Exit 0 even when the run generates no image (no record, or every request "
                                    "invalid or failed).", switch=True, default=False),
    # --- model
    Option("model", "model", "FLUX.2 [klein] checkpoint in diffusers layout: a local folder, a gs:// prefix or a "
                             "Hugging Face Hub id owner/name[@rev].",
           metavar="CHECKPOINT",
           shown_default="the demo's tiny random-weight checkpoint"),
    Option("demo_checkpoint", "model", "Run --input on the bundled tiny random-weight demo checkpoint (noise "
                                       "images): try an input without a real model.",
           switch=True, default=False),
    Option("model_revision", "model", "Branch, tag or commit of a Hugging Face Hub --model (as owner/name@REV).",
           metavar="REV", shown_default="the repository's default branch"),
    Option("model_variant", "model", "Weight-file variant of the checkpoint, as diffusers' variant= (fp16 for "
                                     "*.fp16.safetensors).", metavar="VARIANT",
           shown_default="the files without a variant"),
    Option("vae", "model", "Another VAE in place of the checkpoint's: a folder or .safetensors file with its "
                           "config.json, gs:// or a Hub id.",
           metavar="SOURCE", shown_default="the checkpoint's vae/"),
    Option("dtype", "model", "Compute dtype of the model.", choices=DTYPES,
           shown_default=f"{LoadSettings.dtype}; {DEMO_DTYPE} for the demo checkpoint"),
    Option("quantize", "model", "int8: projections in int8 (faster, less memory; images differ slightly: run "
                                "benchmarks.quality first).", choices=QUANTIZE_MODES, default=EngineOptions.quantize),
    Option("max_sequence_length", "model", "Text-encoder tokens per prompt; longer prompts are truncated and "
                                           "flagged in the manifest.", type=int,
           default=DEFAULT_MAX_SEQUENCE_LENGTH, metavar="TOKENS"),
    Option("model_cache", "model", "gs:// prefix to which a Dataflow launch copies a Hugging Face Hub --model "
                                   "for its workers, once per commit.", metavar="GS_PREFIX",
           shown_default="--temp_location"),
    Option("lora", "model", "LoRA adapter merged into the transformer: a .safetensors file or folder, gs:// path or "
                            "Hub id; repeat or use commas.",
           repeat=True, metavar="[NAME=]SOURCE[:SCALE]", shown_default="none"),
    Option("lora_per_record", "model", "Apply the --lora adapters unmerged instead: each record picks one by NAME in "
                                       "its lora column, or none (the base model).", switch=True, default=False),
    Option("checkpoint_cache_dir", "model", "Local folder for the copy of a gs:// checkpoint.", metavar="FOLDER",
           shown_default="checkpoints/ in $FLUX2_KLEIN_CACHE or ~/.cache/flux2-klein-beam"),
    # --- generation
    Option("height", "generation", "Image height in pixels for records that give none; a multiple of 16 (the "
                                   "checkpoint's size multiple).", type=int, metavar="PIXELS",
           shown_default=f"{DEFAULT_SIZE}; {DEMO_SIZE} for the demo checkpoint"),
    Option("width", "generation", "Image width in pixels for records that give none; a multiple of 16 (the "
                                  "checkpoint's size multiple).", type=int, metavar="PIXELS",
           shown_default=f"{DEFAULT_SIZE}; {DEMO_SIZE} for the demo checkpoint"),
    Option("num_inference_steps", "generation", "Denoising steps for records that give none.", type=int,
           metavar="STEPS", shown_default="the checkpoint's: 4 distilled, 50 base"),
    Option("guidance_scale", "generation", "Guidance scale for records that give none; ignored by the "
                                           "guidance-distilled models.", type=float, metavar="SCALE",
           shown_default="the checkpoint's"),
    Option("num_images", "generation", "Images per prompt for records that give none; image j uses seed + j.",
           type=int, default=DEFAULT_NUM_IMAGES, metavar="N"),
    Option("seed", "generation", "Base seed: a record without a seed gets one derived from this and its id.",
           type=int, default=DEFAULT_SEED, metavar="SEED"),
    # --- performance and limits
    Option("batch_size", "limits", "Images per generate call (the compiled batch; a short one is padded); auto: the "
                                   "fastest that fits the TPU chips.",
           type=batch_size_value, default=AUTO_BATCH, metavar="N|auto",
           shown_default=f"auto (found at launch for TPU workers and a local TPU; else {DEFAULT_BATCH_SIZE})"),
    Option("max_batch_size", "limits", "Largest batch --batch_size auto may pick.", type=int,
           default=DEFAULT_MAX_BATCH_SIZE, metavar="N"),
    Option("model_shards", "limits", "Chips that share one copy of the weights (tensor parallel); the copies on a "
                                     "host split the batch.", type=int, default=EngineOptions.model_shards,
           metavar="N"),
    Option("large_model", "limits", "Load one model per machine, shared by its worker processes (Beam "
                                    "RunInference large_model).", switch=True, default=False),
    Option("model_copies", "limits", "Exact number of model copies per machine, shared by its worker processes "
                                     "(Beam RunInference model_copies).", type=int, metavar="N",
           shown_default="one per worker process"),
    Option("encode_threads", "limits", "Threads per worker process that encode and upload images while the "
                                       "device generates the next batch.", type=int, metavar="N",
           shown_default="the worker's cores"),
    Option("compilation_cache_dir", "limits", "XLA compilation cache (folder or gs://) shared by the workers, and "
                                              "the TPU preflight's answers; 'off' turns it off.", metavar="FOLDER",
           shown_default="{temp_location}/flux2-klein-xla-cache on Dataflow, the project's cache folder locally"),
    Option("max_pixels", "limits", "Largest height x width a record may ask for.", type=int,
           default=DEFAULT_MAX_PIXELS, metavar="PIXELS", shown_default=f"{DEFAULT_MAX_PIXELS} = 2048 x 2048"),
    Option("max_prompt_bytes", "limits", "Largest prompt in UTF-8 bytes; a longer one is an error row naming its "
                                         "size and the limit.", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
           metavar="BYTES", shown_default=f"{DEFAULT_MAX_PROMPT_BYTES} = 64 KiB"),
    Option("max_reference_images", "limits", "Most reference images one record may list (reference_images); a "
                                             "record with more is an error row.", type=int,
           default=DEFAULT_MAX_REFERENCE_IMAGES, metavar="N"),
    Option("max_reference_pixels", "limits", "Largest reference image, width x height as stored; a larger one is "
                                             "an error row, refused before decoding.", type=int,
           default=DEFAULT_MAX_REFERENCE_PIXELS, metavar="PIXELS",
           shown_default=f"{DEFAULT_MAX_REFERENCE_PIXELS} = 4096 x 4096"),
    Option("reference_root", "limits", "Folders or gs:// prefixes reference images may be read from; others are "
                                       "error rows. Repeat the flag or use commas.", repeat=True,
           metavar="FOLDERS", shown_default="the folders of the --input files; none for BigQuery input"),
    Option("max_images", "limits", "Most images one job may generate; a job that would generate more fails "
                                   "before generating any.", type=int, default=DEFAULT_MAX_IMAGES, metavar="N"),
    # --- reliability
    Option("inference_retries", "reliability", "Times a failed batch is run again before its images become "
                                               "error rows (bad input never; out of memory: in halves).", type=int,
           default=DEFAULT_INFERENCE_RETRIES, metavar="N"),
    Option("inference_timeout_s", "reliability", "Seconds one batch's generate call may take (first batch of a shape "
                                                 "compiles within it); then error rows. 0: no limit.", type=int,
           default=DEFAULT_INFERENCE_TIMEOUT_S, metavar="SECONDS"),
    Option("read_timeout_s", "reliability", "Seconds one read of an input file or reference image may stall; then "
                                            "that file's or record's error row.",
           type=int, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS"),
    Option("require_accelerator", "reliability", "Stop at model load when JAX on a worker finds another platform "
                                                 "(CPU: no libtpu or NVIDIA driver).",
           choices=ACCELERATORS, shown_default="none: any platform"),
    Option("skip_preflight", "reliability", "Submit a TPU job without first compiling it for the workers' chips to "
                                            "check that it fits.", switch=True, default=False),
    Option("worker_env", "reliability", "Environment variables set on each worker before the model loads, as "
                                        "NAME=value pairs separated by ';'.", metavar="NAME=value;..."),
    # --- scores and filters
    Option("score_model", "scores", f"CLIP checkpoint (transformers' layout: folder, gs:// or Hub id, e.g. "
                                    f"{DEFAULT_SCORE_MODEL}) scoring each image.",
           metavar="CHECKPOINT", shown_default="none: no scores"),
    Option("score_labels", "scores", "Zero-shot labels, comma-separated: each image gets the probability of each "
                                     "(score label:TEXT).", metavar="TEXT,TEXT,..."),
    Option("score_heads", "scores", "A head on the image embedding in LAION's aesthetic-predictor layout "
                                    "(safetensors, local or gs://); repeat the flag.", repeat=True,
           metavar="NAME=FILE"),
    Option("min_score", "scores", "Leave out images whose score is below the threshold (under filtered/, kept in "
                                  "the manifest); repeat the flag.", repeat=True, metavar="SCORE=THRESHOLD"),
    Option("max_score", "scores", "Leave out images whose score is above the threshold (under filtered/, kept in "
                                  "the manifest); repeat the flag.", repeat=True, metavar="SCORE=THRESHOLD"),
)

# Names of the options above, in --help order (for tooling such as the Flex Template metadata).
OPTION_NAMES = tuple(option.name for option in OPTIONS)


def options_by_group() -> list[tuple[str, list[Option]]]:
    """(title, options) for each group of GROUPS that has options, in order; ValueError naming an option whose
    group is not in GROUPS (it would otherwise be missing from --help)."""
    titles = dict(GROUPS)
    for option in OPTIONS:
        if option.group not in titles:
            raise ValueError(f"option --{option.name} has group {option.group!r}, which is not one of {list(titles)}")
    grouped = [(title, [o for o in OPTIONS if o.group == key]) for key, title in GROUPS]
    return [(title, options) for title, options in grouped if options]
