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


def lab():
    from model.lab import LabSwitches

    return LabSwitches()


def reference_lab():
    from model.lab import reference_mode

    return reference_mode()["lab"]


def engine_options():
    from model.options import EngineOptions

    return EngineOptions()


def auto_attention(masked: bool, platform: str, dtype=None) -> str:
    from model.attention import resolve_implementation

    return resolve_implementation("auto", masked=masked, platform=platform, dtype=dtype)


def cpu_mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", "model"))


def upsample_forms() -> tuple[str, str]:
    """(the form on TPUs, the form the engine picks on a CPU mesh)."""
    from model.engine import upsample_form

    return lab().tpu_upsample, upsample_form(lab(), cpu_mesh())


def cpu_concurrent_images() -> int:
    """The images run at once that the engine resolves on a one-device CPU mesh from the default options."""
    from model.cpu_images import concurrent_images_for

    return concurrent_images_for(cpu_mesh(), engine_options())


def off_by_default() -> set[str]:
    """The lab's optimisations whose default is the reference mode's value (off): `reference` selects the mode."""
    default, reference = lab(), reference_lab()
    return {f.name for f in dataclasses.fields(default)
            if f.name != "reference" and getattr(default, f.name) == getattr(reference, f.name)}


ON = {"on": True, "off": False}
PASSES = {"one": True, "two": False, "one pass": True, "two passes": False}  # GroupNorm's one_pass
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
    Documented("GroupNorm: one pass by default, two in the reference mode",
               docstring("model.layers:GroupNorm.__call__"),
               r"`LabSwitches\.vae_one_pass_norm`: (one|two)(?: pass(?:es)?)? by default, (one|two)(?: pass(?:es)?)? "
               r"in the reference mode",
               lambda m: (PASSES[m[1]], PASSES[m[2]]),
               lambda: (lab().vae_one_pass_norm, reference_lab().vae_one_pass_norm)),
    Documented("developers.md: the VAE's GroupNorms in one pass", repo_file("docs/developers.md"),
               r"The VAE's GroupNorms take E\[x\] and E\[x\^2\] in (one pass|two passes)",
               lambda m: PASSES[m[1]], lambda: lab().vae_one_pass_norm),
    Documented("called_directly: per-layer tracing is the reference mode's", docstring("model.layers:called_directly"),
               r"`LabSwitches\.layers_traced_once` (on|off), as in the reference mode; (on|off) by default",
               lambda m: (ON[m[1]], ON[m[2]]),
               lambda: (reference_lab().layers_traced_once, lab().layers_traced_once)),
    Documented("LabSwitches.layers_traced_once's comment",
               field_comment("model.lab:LabSwitches", "layers_traced_once"),
               r"(on|off) by default", lambda m: ON[m[1]], lambda: lab().layers_traced_once),
    Documented("LabSwitches.vae_splash's comment", field_comment("model.lab:LabSwitches", "vae_splash"),
               r"(On|Off) by default", lambda m: ON[m[1].lower()], lambda: lab().vae_splash != "off"),
    Documented("LabSwitches: all on by default but those named", docstring("model.lab:LabSwitches"),
               r"all on by default but ((?:`\w+`(?:, | and )?)+)",
               lambda m: set(re.findall(r"`(\w+)`", m[1])), off_by_default),
    Documented("heads_kernel's default mode", repo_file("model/heads_kernel.py"),
               r'"(\w+)" \(the default', lambda m: m[1], lambda: lab().heads_kernel),
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
    Documented("EngineOptions.concurrent_images's None",
               field_comment("model.options:EngineOptions", "concurrent_images"),
               r"None = (\d+) where `per_image` applies on CPU", lambda m: int(m[1]), cpu_concurrent_images),
    Documented("developers.md: the premapped transfer buffer", repo_file("docs/developers.md"),
               r"a (\d+) GiB premapped transfer buffer", lambda m: int(m[1]) << 30,
               imported("model.runtime:DEFAULT_PREMAPPED_BUFFER_BYTES")),
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
