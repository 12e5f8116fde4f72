"""What the docstrings, comments and developer docs say a default is, against the default the code imports.

Each row of DOCUMENTED names where a default is stated (a docstring, a field's comment, a file), a pattern that
reads the stated value out of that text, and the value the code has. A row fails when the text no longer states
the default in those words (reword the text or the row) or states another value than the code's (fix the text).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
from typing import Any, Callable

import pytest

from paths import REPO


def flat(text: str) -> str:
    """`text` with comment markers dropped and every run of whitespace one space, so a pattern may span lines."""
    return " ".join(" ".join(re.sub(r"^\s*#", " ", line) for line in text.splitlines()).split())


def repo_file(path: str) -> Callable[[], str]:
    def read():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            return f.read()
    return read


def docstring(dotted: str) -> Callable[[], str]:
    """The docstring of `module:attribute.path`."""
    def read():
        return inspect.getdoc(_resolve(dotted)) or ""
    return read


def field_comment(dotted: str, field: str) -> Callable[[], str]:
    """The comment of dataclass `module:Class`'s `field`: the comment lines right above its line and the one on it."""
    def read():
        lines = inspect.getsource(_resolve(dotted)).splitlines()
        at = next(i for i, line in enumerate(lines) if re.match(rf"\s+{field}\s*:", line))
        start = at
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        own = lines[at].partition("#")[2] if "#" in lines[at] else ""
        return "\n".join(lines[start:at] + [own])
    return read


def _resolve(dotted: str):
    module, _, attribute = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        obj = getattr(obj, part)
    return obj


def imported(dotted: str) -> Callable[[], Any]:
    """The value of `module:name`, imported when the row runs."""
    return lambda: _resolve(dotted)


def engine_options():
    from model.options import EngineOptions

    return EngineOptions()


def auto_attention(masked: bool, platform: str, dtype=None) -> str:
    from model.nets.attention import resolve_implementation

    return resolve_implementation("auto", masked=masked, platform=platform, dtype=dtype)


def cpu_mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", "model"))


def upsample_forms() -> tuple[str, str]:
    """(the upsample's form on TPUs, elsewhere)."""
    from model.nets.platform_forms import forms_for

    return forms_for("tpu").upsample, forms_for("cpu").upsample


def tpu_forms() -> tuple[str, str]:
    """(RoPE's form, the upsample's form) on TPUs."""
    from model.nets.platform_forms import forms_for

    return forms_for("tpu").rope, forms_for("tpu").upsample


def cpu_concurrent_images() -> int:
    """The images run at once that the engine resolves on a one-device CPU mesh."""
    from model.engine.cpu_images import concurrent_images_for

    return concurrent_images_for(cpu_mesh())


FORMS = {"transposed conv": "dilated"}
KERNELS = {"block-wise online softmax": "blocked", "cuDNN": "cudnn", "XLA": "xla", "Pallas splash kernel": "splash",
           "blocked": "blocked", "xla": "xla", "splash": "splash"}


@dataclasses.dataclass(frozen=True)
class Documented:
    name: str
    text: Callable[[], str]      # where the default is stated
    pattern: str                 # reads the stated value out of that text (flattened: one line)
    stated: Callable[[re.Match], Any]
    actual: Callable[[], Any]    # the default the code has


DOCUMENTED = [
    Documented("platform_forms: the TPU's forms", docstring("model.nets.platform_forms"),
               r"on TPUs RoPE swaps pairs by a (matmul), the VAE upsamples by a (transposed conv)",
               lambda m: (m[1], FORMS[m[2]]), tpu_forms),
    Documented("developers.md: the upsample's forms", repo_file("docs/developers.md"),
               r"The VAE's upsampling convs run as one transposed \(input-(dilated)\) conv on TPUs and as a "
               r"low-resolution 2x2 conv with the four output (phases) as channels elsewhere",
               lambda m: (m[1], m[2]), upsample_forms),
    Documented("EngineOptions.text_encoder_attention's auto",
               field_comment("model.options:EngineOptions", "text_encoder_attention"),
               r"auto = (\w+) on CPU, (\w+) on GPU, (\w+) on TPU \((\w+) for float32 models\)",
               lambda m: tuple(KERNELS[g] for g in m.groups()),
               lambda: (auto_attention(True, "cpu"), auto_attention(True, "gpu"), auto_attention(True, "tpu"),
                        auto_attention(True, "tpu", "float32"))),
    Documented("developers.md: attention auto", repo_file("docs/developers.md"),
               r"`auto` is the (block-wise online softmax) on CPU, (cuDNN) \(transformer\) / (XLA) \(encoder\) on "
               r"GPU, the (Pallas splash kernel) on one TPU",
               lambda m: tuple(KERNELS[g] for g in m.groups()),
               lambda: (auto_attention(False, "cpu"), auto_attention(False, "gpu"), auto_attention(True, "gpu"),
                        auto_attention(False, "tpu"))),
    Documented("developers.md: max_buckets", repo_file("docs/developers.md"), r"`max_buckets` \((\d+):",
               lambda m: int(m[1]), lambda: engine_options().max_buckets),
    Documented("cpu_images: images run at once", repo_file("model/engine/cpu_images.py"),
               r"so (\d+) at once make more images per second", lambda m: int(m[1]), cpu_concurrent_images),
    Documented("developers.md: the premapped transfer buffer", repo_file("docs/developers.md"),
               r"a (\d+) GiB premapped transfer buffer", lambda m: int(m[1]) << 30,
               imported("model.engine.runtime:DEFAULT_PREMAPPED_BUFFER_BYTES")),
    Documented("developers.md: --png_compress_level", repo_file("docs/developers.md"),
               r"`--png_compress_level` defaults to (\d+)", lambda m: int(m[1]),
               imported("transforms.layout:DEFAULT_PNG_COMPRESS_LEVEL")),
    Documented("the handler's default --batch_size", repo_file("transforms/inference.py"),
               r"The default --batch_size of (\d+)", lambda m: int(m[1]),
               imported("model.options:DEFAULT_BATCH_SIZE")),
]


@pytest.mark.parametrize("row", DOCUMENTED, ids=[row.name for row in DOCUMENTED])
def test_the_documented_default_is_the_code_default(row: Documented):
    """The text states the default in the row's words, and the value it states is the one the code has."""
    text = flat(row.text())
    match = re.search(row.pattern, text)
    assert match, f"{row.name}: the text no longer states the default as /{row.pattern}/ (reword it or this row)"
    assert row.stated(match) == row.actual(), f"{row.name}: the text says {match.group()!r}"
