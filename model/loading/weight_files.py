"""Which safetensors files of a component folder to load: the default ones or those of a diffusers/transformers
`variant` (e.g. `model.fp16.safetensors` next to `model.safetensors`). Pure name logic, shared by the local reader
(`model.loading.safetensors_file`) and the GCS copy (`model.loading.checkpoint`, which downloads only the chosen
files)."""

from __future__ import annotations

import logging
import re
from typing import Iterable

from ..errors import CheckpointError
from ..options import validate_variant

logger = logging.getLogger(__name__)

_SHARD_NUMBER = re.compile(r"-\d+-of-\d+$")
_INDEX_NAME = re.compile(r".+\.safetensors\.index(?:\.([^/]+))?\.json")


def weight_file_variant(name: str) -> tuple[str, str | None] | None:
    """("weights" or "index", variant) for a safetensors file or index name; None for any other file.

    diffusers' and transformers' `save_pretrained(variant="fp16")` write `model.fp16.safetensors`, shards
    `model.fp16-00001-of-00002.safetensors` (older diffusers: `model-00001-of-00002.fp16.safetensors`) and the index
    `model.safetensors.index.fp16.json`; without a variant, `model.safetensors` and `model.safetensors.index.json`."""
    if name.endswith(".safetensors"):
        parts = name[: -len(".safetensors")].split(".")
        return "weights", (_SHARD_NUMBER.sub("", parts[-1]) or None) if len(parts) > 1 else None
    match = _INDEX_NAME.fullmatch(name)
    return ("index", match.group(1)) if match else None


def select_weight_files(names: Iterable[str], variant: str | None, folder: str) -> list[str]:
    """The safetensors files and index (the one `.json` among them) of `names` (one folder's files) that belong to
    the variant to load.

    `variant` None: the files without a variant, or, when there are none, those of the only variant present. A
    variant asked for that the folder lacks falls back to the files without one (as diffusers does)."""
    validate_variant(variant)
    groups: dict[str | None, list[str]] = {}
    for name in names:
        kind = weight_file_variant(name)
        if kind is not None:
            groups.setdefault(kind[1], []).append(name)
    if variant in groups:
        chosen = variant
    elif None in groups:
        chosen = None
        if variant is not None:
            logger.info("%s has no %r variant weights; loading its default weights", folder, variant)
    elif not groups:
        return []
    elif variant is None and len(groups) == 1:
        chosen = next(iter(groups))
        logger.info("%s has only %r variant weights; loading them", folder, chosen)
    else:
        present = sorted(groups, key=str)
        what = (f"no weights for variant {variant!r} here and no default weights; the variants present are {present}"
                if variant is not None else f"no default weights here but several variants {present}")
        raise CheckpointError(f"{what}: choose one (model.load(..., variant=...), --model_variant in the job)",
                              path=folder)
    ignored = sorted(n for v, files in groups.items() if v != chosen for n in files)
    if ignored:
        logger.debug("ignoring the other variants' weight files in %s: %s", folder, ignored)
    return sorted(groups[chosen])
