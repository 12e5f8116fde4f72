"""The launch's checks of --score_model and --score_heads: a local CLIP folder must hold a CLIPModel config and a
local head file must be in LAION's layout, so that a wrong file fails before any worker starts, naming it. gs:// and
Hub sources are checked by the workers as they load them."""

from __future__ import annotations

import os

from .errors import UsageError


def check_scores(settings) -> None:
    """UsageError naming the file for a local score model or head that the scorer would refuse."""
    from model.errors import ModelError
    from model.engine.scoring import check_heads
    from model.nets.clip import read_config

    try:
        if os.path.isdir(settings.model):
            config = read_config(settings.model)
            check_heads(settings, config.projection_dim)
        elif not settings.model.startswith("gs://") and "/" in settings.model and os.path.exists(settings.model):
            raise UsageError(f"--score_model={settings.model!r} is a file; give the CLIP checkpoint's folder")
    except ModelError as e:
        raise UsageError(f"--score_model / --score_heads: {e}") from None
