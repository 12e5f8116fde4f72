"""Which batch to compile next when searching the largest batch whose programs fit a chip, and which of the batches
that fit is the fastest per image: pure arithmetic on the batches compiled so far (and on the estimates), so the
search is tested without compiling. Importing it does not load JAX.

A program's bytes grow with its batch, so the largest batch that fits lies below the smallest that did not. Each
next batch is where a line through the bytes of the batches nearest that boundary meets the chip's free HBM, kept
strictly between the largest batch that fitted and the smallest that did not: every guess is compiled to check it,
and the search ends when those two are neighbours (or the cap fits).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Trial:
    """One compiled batch (per data replica): whether it fitted, and its bytes per chip beyond the parameters (a lower
    bound when the compiling stopped at a program that already did not fit)."""

    batch: int
    fits: bool
    transient_bytes: int


def bounds(trials, cap: int) -> tuple[int, int]:
    """(the largest batch that fitted, 0 if none; the smallest that did not, cap + 1 if none)."""
    fitting = max((t.batch for t in trials if t.fits), default=0)
    failing = min((t.batch for t in trials if not t.fits), default=cap + 1)
    return fitting, failing


def best_batch(trials, cap: int) -> int:
    """The largest batch known to fit below the smallest known not to (0: none fits)."""
    _, failing = bounds(trials, cap)
    return max((t.batch for t in trials if t.fits and t.batch < failing), default=0)


def next_batch(trials, capacity_left: float, cap: int) -> int | None:
    """The next batch to compile, or None when the largest batch up to `cap` that fits is known (`best_batch`).
    `capacity_left`: the chip's HBM less the resident parameters. Until one fits: 1, the smallest (if it does not fit,
    no batch does). One trial: all its bytes taken as per image (the line through zero, which over-states the bytes
    of a larger batch, so the guess errs low). Two or more: the line through the largest fitting batch and the
    smallest failing one (or the fitting one below it)."""
    if cap < 1:
        return None
    fitting, failing = bounds(trials, cap)
    if fitting == 0:  # the smallest batch decides whether any fits
        return 1 if failing > 1 else None
    if failing <= fitting + 1:
        return None
    by_batch = {t.batch: t.transient_bytes for t in trials}
    if len(by_batch) == 1:
        (b, t), = by_batch.items()
        guess = int(capacity_left * b // t) if t > 0 else failing - 1
    else:
        other = failing if failing in by_batch else max(b for b in by_batch if b != fitting and b < failing)
        (x0, y0), (x1, y1) = sorted(((fitting, by_batch[fitting]), (other, by_batch[other])))
        slope = (y1 - y0) / (x1 - x0)
        guess = int(x0 + (capacity_left - y0) // slope) if slope > 0 else failing - 1
    return min(max(guess, fitting + 1), failing - 1)


# Estimates within this share of the fastest are a tie, and the smallest of them wins: a smaller batch starts its
# first image sooner and needs less of the chip, for no time that the estimate can tell apart.
NEAR_TIE = 0.01


def fastest(seconds_per_image: dict) -> int:
    """The batch whose estimated seconds per image is the least, or the smallest within NEAR_TIE of it."""
    least = min(seconds_per_image.values())
    return min(b for b, s in seconds_per_image.items() if s <= least * (1 + NEAR_TIE))
