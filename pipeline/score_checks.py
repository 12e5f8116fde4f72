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


# openai/clip-vit-large-patch14's shapes (the documented default), for a score model the launch cannot read.
DEFAULT_CLIP_CONFIG = {
    "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "patch_size": 14},
    "projection_dim": 768,
}


def reserved_bytes(settings, dtype: str, height: int, width: int, batch: int) -> int:
    """Per-chip bytes the TPU preflight keeps free for the scorer (model.engine.scoring.scorer_bytes): a local score
    model's own shapes, else ViT-L/14's; the heads by their files' sizes when local."""
    from model.engine.scoring import scorer_bytes
    from model.nets.clip import CLIPConfig, read_config

    config = read_config(settings.model) if os.path.isdir(settings.model) else CLIPConfig.from_dict(
        DEFAULT_CLIP_CONFIG)
    heads = sum(os.path.getsize(s) // 4 for _, s in settings.heads if os.path.isfile(s))
    return scorer_bytes(config, 2 if dtype == "bfloat16" else 4, height, width, batch, heads)
