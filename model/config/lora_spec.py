"""A LoRA adapter as the user names it: `[NAME=]SOURCE[:SCALE]` (the job's --lora, model.load's `loras`).

Imports nothing heavy: the options and the launch parse adapters before any weight is read."""

from __future__ import annotations

import dataclasses
import math
import os
import re

# The file diffusers' save_lora_weights writes, taken where a folder or repository holds several.
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """One adapter as asked for: its source, its scale (diffusers' adapter weight) and the name records pick it by
    (default: the weight file's stem)."""

    source: str
    scale: float = 1.0
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        """`[NAME=]SOURCE[:SCALE]`, e.g. `style=gs://bucket/style.safetensors:0.8`; ValueError if malformed."""
        text = str(text).strip()
        name = None
        head, sep, rest = text.partition("=")
        if sep and _NAME.fullmatch(head) and "/" not in head:
            name, text = head, rest
        source, scale = text, 1.0
        body, sep, tail = text.rpartition(":")
        if sep and body:
            try:
                scale, source = float(tail), body
            except ValueError:
                pass
        if not source:
            raise ValueError(f"--lora {text!r}: no source (expected [NAME=]SOURCE[:SCALE])")
        if not math.isfinite(scale):
            raise ValueError(f"--lora {text!r}: scale must be a finite number")
        return cls(source=source, scale=scale, name=name)

    @property
    def label(self) -> str:
        """The name records use: the given one, else the weight file's (or folder's) stem."""
        if self.name:
            return self.name
        base = os.path.basename(self.source.rstrip("/"))
        return base.removesuffix(".safetensors") or self.source


