"""The bundled demo: what `python -m pipeline.run` runs when given neither --model nor --input, and the checkpoint
that `--demo_checkpoint` runs the user's own --input on.

A tiny random-weight FLUX.2 [klein] checkpoint, built on first use by the fixture builder `tiny_klein` (outside the
runtime packages; building needs the `[demo]` extra, torch and diffusers) into the project's cache folder
(model/loading/cache_paths.py) and reused, run on the bundled prompts at 128x128 in float32. Everything the job does
only for the demo is here; pipeline/run.py calls in. `tiny_klein` is imported only when the demo runs, so importing the
pipeline never imports it.
"""

from __future__ import annotations

import os

from .errors import UsageError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_PROMPTS = os.path.join(REPO_ROOT, "examples", "prompts.jsonl")
# Image height and width unless --height / --width say otherwise. The demo checkpoint has the real model's VAE scale
# (8) and 2x2 patch, so 128x128 makes an 8x8 grid of image tokens (64x64 only 4x4) and runs as fast: compiling
# dominates the demo's seconds at either size.
DEMO_SIZE = 128
DEMO_DTYPE = "float32"  # unless --dtype says otherwise

DEMO_NOTICE = """\
==> Running the bundled demo: a tiny RANDOM-WEIGHT FLUX.2 [klein] checkpoint (built once, then reused) at
      {model}
    on the prompts in {input}, writing to {output}.
    Random weights give noise images: this shows the job end to end (layout, manifest, errors, metrics), not the
    model's quality. To generate real images, point --model at a real FLUX.2 [klein] checkpoint in diffusers
    layout: a Hugging Face Hub id (black-forest-labs/FLUX.2-klein-4B, FLUX.2-klein-9B, FLUX.2-klein-base-4B,
    FLUX.2-klein-base-9B; the 9B and base models are gated), a local folder or a gs:// copy, for example
      python -m pipeline.run --model=black-forest-labs/FLUX.2-klein-4B --input=my_prompts.jsonl --output=./out
"""

DEMO_CHECKPOINT_NOTICE = """\
==> --demo_checkpoint: your prompts on the bundled tiny RANDOM-WEIGHT checkpoint
      {model}
    at the demo's size and dtype unless --height/--width/--dtype say otherwise. The images are noise: this checks
    your input and the job's outputs, not the model. Give --model=CHECKPOINT instead for real images.
"""

DEMO_DONE = ("demo done: the images are noise (random weights). Use --model with a real FLUX.2 [klein] checkpoint "
             "for real images.")


def demo_checkpoint() -> str:
    """The demo checkpoint's folder, built on first use; UsageError when the reference libraries are missing."""
    try:
        from tiny_klein import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    except ImportError as e:
        raise UsageError(f"the demo builds its tiny checkpoint with the reference libraries ({e}); install them "
                         f"with: pip install -e '.[demo]'") from e


def demo_notice(model: str, prompts: str, output: str) -> str:
    """What the demo prints before it starts: which checkpoint, prompts and output, and how to run a real model."""
    return DEMO_NOTICE.format(model=model, input=prompts, output=output)
