"""What a Hugging Face Hub id given as `--model` becomes at launch: the checkpoint location the workers load.

The launch resolves the id once (model/hub.py: download into the local cache, or the cached snapshot offline); a
failure is a UsageError (exit status 2) that says what to do. The workers load the local snapshot folder.
"""

from __future__ import annotations

import logging

from model.errors import HubError, ModelError
from model.hub import resolve_hub

from .errors import UsageError

logger = logging.getLogger(__name__)


def hub_model(model: str, variant: str | None) -> str:
    """The location the workers load for the Hub id `model`: the local snapshot folder. UsageError naming the
    option for anything that stops it."""
    try:
        snapshot = resolve_hub(model, variant)
    except HubError as e:
        raise UsageError(f"--model={model!r}: {e}") from e
    except ModelError as e:
        raise UsageError(f"--model={model!r} cannot be used as a FLUX.2 [klein] checkpoint: {e}") from e
    return snapshot.path
