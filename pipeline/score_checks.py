"""The launch's checks of --score_model and --score_heads (a local CLIP folder must hold a CLIPModel config, a local
head file LAION's layout: a wrong file fails before any worker starts, naming it), and what the TPU preflight keeps
free for the scorer."""

from __future__ import annotations

from .errors import UsageError


def check_scores(settings) -> None:
    """UsageError naming the file for a local score model or head that the scorer would refuse."""
    import model

    try:
        model.check_score_files(settings)
    except model.ModelError as e:
        raise UsageError(f"--score_model / --score_heads: {e}") from None


def reserved_bytes(settings, dtype: str, height: int, width: int, batch: int) -> int:
    """Per-chip bytes the preflight leaves to the scorer (model.scorer_reserved_bytes)."""
    import model

    return model.scorer_reserved_bytes(settings, dtype, height, width, batch)
