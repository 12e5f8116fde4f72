"""Tiny random-weight FLUX.2 [klein] checkpoints in the exact diffusers layout, for the tests, the demo and the
benchmarks (the code is in builder.py).

Not part of the runtime: model/, transforms/ and pipeline/ never import this package; the demo (pipeline/demo.py)
imports it only when it runs. Importing it needs only the standard library; building a checkpoint needs the
reference stack (torch and diffusers: pip install -e '.[demo]').
"""

from .builder import (
    DEMO_SPEC, QWEN3_CHAT_TEMPLATE, SPECIAL_TOKENS, TinySpec, build_tiny_checkpoint, build_tiny_tokenizer,
    ensure_demo_checkpoint, spec_hash,
)

__all__ = [
    "TinySpec",
    "DEMO_SPEC",
    "QWEN3_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_checkpoint",
    "build_tiny_tokenizer",
    "ensure_demo_checkpoint",
    "spec_hash",
]
