"""The job's pipeline options: every option of the model API, the input/output locations and the job's switches.

Standard Beam options (`--runner`, `--direct_running_mode`, `--direct_num_workers`, Dataflow's `--project`,
`--region`, `--temp_location`, `--sdk_container_image`, ...) are parsed by Beam itself and pass straight through.

Every option takes `--name=value`, which is how Dataflow Flex Templates pass parameters; the switches
(`--skip_existing`, `--large_model`, `--no_progress`) also work bare, and take `=true` / `=false`.
"""

from __future__ import annotations

import argparse

from apache_beam.options.pipeline_options import PipelineOptions

from model.contract import (
    DEFAULT_MAX_PIXELS, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_SIZE,
)
from model.options import DTYPE_NAMES as DTYPES
from transforms.inference import DEFAULT_INFERENCE_RETRIES
from transforms.columns import RENAMABLE
from transforms.requests import DEFAULT_MAX_METADATA_BYTES, FORMATS

from .demo import DEMO_DTYPE, DEMO_SIZE

DEFAULT_OUTPUT = "./output"
DEFAULT_BATCH_SIZE = 4
INPUT_FORMATS = ("auto",) + FORMATS
DEFAULT_MAX_IMAGES = 10_000_000


def str2bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "y", "on"):
        return True
    if text in ("0", "false", "no", "n", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _flag(parser, name: str, help_text: str) -> None:
    parser.add_argument(name, nargs="?", const=True, default=False, type=str2bool, help=help_text)


class Flux2KleinOptions(PipelineOptions):
    """Options of `python -m pipeline.run` (FLUX.2 [klein] batch text-to-image)."""

    @classmethod
    def _add_argparse_args(cls, parser):
        g = parser.add_argument_group("FLUX.2 [klein] batch job")
        # --- where things are
        g.add_argument("--input", action="append", default=None,
                       help="Prompt files or globs, gs:// or local; repeat the flag or separate with commas. "
                            "JSONL (prompt, id, seed, height, width, num_inference_steps, guidance_scale, "
                            "num_images), CSV with a header of the same names, or text (one prompt per line). "
                            "Omit both --input and --model to run the bundled demo.")
        g.add_argument("--input_format", default="auto", choices=INPUT_FORMATS,
                       help="Input format; 'auto' picks it from each file's extension (.jsonl/.ndjson/.json, .csv, "
                            "anything else is text).")
        g.add_argument("--output", default=None,
                       help=f"Output folder or gs:// prefix (images/, manifest/, errors/, summary.json). "
                            f"Default {DEFAULT_OUTPUT} for local runners; required (gs://) on Dataflow.")
        g.add_argument("--model", default=None,
                       help="Diffusers-layout FLUX.2 [klein] checkpoint: local folder or gs:// prefix (copied "
                            "once per worker machine, checksum-verified). Omit with --input for the demo.")
        g.add_argument("--model_variant", default=None,
                       help="Weight-file variant of --model, as diffusers' variant= (e.g. fp16 for "
                            "*.fp16.safetensors). Default: the files without a variant, or a component's only variant.")
        # --- the model API
        g.add_argument("--dtype", default=None, choices=DTYPES,
                       help=f"Compute dtype of the model (default bfloat16; {DEMO_DTYPE} for the demo).")
        g.add_argument("--height", type=int, default=None,
                       help=f"Image height for records that do not give one (a multiple of the checkpoint's size "
                            f"multiple: 16 for FLUX.2 [klein]; default {DEFAULT_SIZE}, {DEMO_SIZE} for the demo).")
        g.add_argument("--width", type=int, default=None,
                       help=f"Image width for records that do not give one (a multiple of the checkpoint's size "
                            f"multiple: 16 for FLUX.2 [klein]; default {DEFAULT_SIZE}, {DEMO_SIZE} for the demo).")
        g.add_argument("--num_inference_steps", type=int, default=None,
                       help="Denoising steps for records that do not say (default: the checkpoint's, 4 for "
                            "the distilled klein models, 50 for the base ones).")
        g.add_argument("--guidance_scale", type=float, default=None,
                       help="Guidance scale for records that do not say (default: the checkpoint's; ignored by "
                            "the guidance-distilled models).")
        g.add_argument("--num_images", type=int, default=1,
                       help="Images per prompt for records that do not say; image j uses seed + j.")
        g.add_argument("--max_sequence_length", type=int, default=None,
                       help=f"Text-encoder tokens per prompt (default {DEFAULT_MAX_SEQUENCE_LENGTH}); longer prompts "
                            f"are truncated, counted and flagged in the manifest.")
        g.add_argument("--batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                       help="Compiled batch size (images per generate call); short batches are padded.")
        g.add_argument("--seed", type=int, default=0,
                       help="Base seed: a record without a seed gets one derived from this and its id.")
        g.add_argument("--max_pixels", type=int, default=DEFAULT_MAX_PIXELS,
                       help="Largest height x width accepted (default 4 megapixels).")
        g.add_argument("--max_prompt_bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                       help="Largest prompt accepted, in UTF-8 bytes (default 64 KiB); a longer prompt is an "
                            "error row naming its size and the limit.")
        g.add_argument("--max_images", type=int, default=DEFAULT_MAX_IMAGES,
                       help="Most images one job may generate (default 10,000,000). A job that would generate "
                            "more fails before generating any, naming both numbers; nothing is half done.")
        # --- the job
        _flag(g, "--skip_existing", "Skip requests whose image already exists under the output (resume a job).")
        _flag(g, "--large_model", "Load one model per machine, shared by every worker process on it (Beam "
                                  "RunInference large_model), instead of one per process.")
        g.add_argument("--model_copies", type=int, default=None,
                       help="Exact number of model copies per machine, shared across processes (Beam "
                            "RunInference model_copies).")
        g.add_argument("--inference_retries", type=int, default=DEFAULT_INFERENCE_RETRIES,
                       help=f"Times a failed inference batch is run again before its images become error rows "
                            f"(default {DEFAULT_INFERENCE_RETRIES}); out-of-memory and bad-input failures are not "
                            f"retried.")
        g.add_argument("--checkpoint_cache_dir", default=None,
                       help="Local folder for copies of gs:// checkpoints (default checkpoints/ in "
                            "$FLUX2_KLEIN_CACHE, else $XDG_CACHE_HOME/flux2-klein-beam or ~/.cache/flux2-klein-beam).")
        g.add_argument("--compilation_cache_dir", default=None,
                       help="Persistent XLA compilation cache (local folder or gs://) so workers skip recompiling.")
        _flag(g, "--no_progress", "Do not print the live progress line (local runners).")
        _add_input_table_args(parser)

    # ------------------------------------------------------------------------------------------------------------
    def input_patterns(self) -> list[str]:
        """--input as a flat list: repeated flags and comma-separated values both work."""
        patterns: list[str] = []
        for value in self.input or []:
            patterns.extend(p.strip() for p in str(value).split(",") if p.strip())
        return patterns


# --- input tables: TSV, Parquet and BigQuery inputs, column mapping and extra columns (transforms/columns.py)
def _add_input_table_args(parser) -> None:
    t = parser.add_argument_group(
        "FLUX.2 [klein] batch job: input tables",
        "--input also takes TSV (.tsv, header required) and Parquet (.parquet) tables and BigQuery tables "
        "(bq://project.dataset.table); --input_format also tsv and parquet. A table's header (or schema) must have "
        "the prompt column, checked at launch; its other columns go to the manifest under 'metadata'.")
    t.add_argument("--prompt_column", default="prompt",
                   help="Column (or JSON key) holding the prompt (default prompt; matched exactly, else ignoring "
                        "case).")
    t.add_argument("--id_column", default="id", help="Column (or JSON key) holding the record's id (default id).")
    t.add_argument("--column_map", default=None,
                   help="Columns named differently from the generation fields, as old=new pairs separated by "
                        "commas, e.g. cfg=guidance_scale,step=num_inference_steps. Targets: "
                        f"{', '.join(RENAMABLE)}.")
    t.add_argument("--max_metadata_bytes", type=int, default=DEFAULT_MAX_METADATA_BYTES,
                   help=f"Largest size of a record's extra columns as JSON, in UTF-8 bytes (default "
                        f"{DEFAULT_MAX_METADATA_BYTES}); a record above it is an error row.")
    t.add_argument("--input_query", default=None,
                   help="A BigQuery standard-SQL query whose rows are the prompt records (with or instead of "
                        "--input); needs --temp_location on gs://.")
    t.add_argument("--bigquery_temp_dataset", default=None,
                   help="BigQuery dataset (project.dataset) to hold --input_query's result; default: a temporary "
                        "dataset Beam creates and deletes.")


INPUT_TABLE_OPTION_NAMES = ("prompt_column", "id_column", "column_map", "max_metadata_bytes", "input_query",
                            "bigquery_temp_dataset")


# Names of the options defined above, in order (for tooling such as the Flex Template metadata).
OPTION_NAMES = (
    "input", "input_format", "output", "model", "dtype", "height", "width", "num_inference_steps", "guidance_scale",
    "num_images", "max_sequence_length", "batch_size", "seed", "max_pixels", "max_prompt_bytes", "max_images",
    "skip_existing", "large_model", "model_copies", "inference_retries", "checkpoint_cache_dir",
    "compilation_cache_dir", "no_progress",
)
OPTION_NAMES += INPUT_TABLE_OPTION_NAMES
