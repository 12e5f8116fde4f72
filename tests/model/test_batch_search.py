"""The search for the largest batch that fits a chip (model/preflight/batch_search.py): which batch is compiled next,
and when the answer is known. Pure arithmetic: a fake chip whose bytes grow by a line with the batch stands for the
compiler."""

import pytest

from model.preflight.batch_search import Trial, best_batch, next_batch


def chip(fixed: int, per_image: int, free: int):
    """A compile of `batch` images on a chip with `free` bytes beside the parameters: fixed + per_image x batch."""
    return lambda batch: Trial(batch, fixed + per_image * batch <= free, fixed + per_image * batch)


def search(compile_batch, free: int, cap: int) -> tuple[int, list[int]]:
    """(the batch found, the batches compiled in order), as model.preflight.aot.fit runs it."""
    trials = []
    while (batch := next_batch(trials, free, cap)) is not None:
        assert batch not in [t.batch for t in trials], "a batch compiled twice"
        trials.append(compile_batch(batch))
    return best_batch(trials, cap), [t.batch for t in trials]


@pytest.mark.parametrize("fixed, per_image, free, cap, expected", [
    (10, 36, 48, 8, 1),    # klein-4B on one v5e chip at 1024x1024 (GiB x 10): batch 2 is 3.6 GiB over
    (2, 3, 40, 16, 12),    # the line's own answer
    (2, 3, 400, 16, 16),   # everything fits: the cap
    (50, 3, 40, 16, 0),    # not even one image
    (0, 5, 40, 8, 8),      # exactly full at the cap
    (7, 1, 9, 8, 2),
])
def test_the_search_finds_the_largest_batch_that_fits(fixed, per_image, free, cap, expected):
    found, compiled = search(chip(fixed, per_image, free), free, cap)
    assert found == expected
    truth = max((b for b in range(1, cap + 1) if fixed + per_image * b <= free), default=0)
    assert found == truth
    assert compiled[0] == 1  # one image first: if it does not fit, nothing does
    assert len(compiled) <= 4, compiled  # the line's guesses, not a walk through every batch


def test_the_first_guess_after_one_image_takes_all_of_its_bytes_per_image():
    """One point: its bytes over one image (the line through zero over-states a larger batch's bytes, so the guess
    errs low and is checked by compiling it)."""
    assert next_batch([Trial(1, True, 5)], 40, 16) == 8
    assert next_batch([Trial(1, True, 5)], 400, 16) == 16  # capped
    assert next_batch([Trial(1, True, 30)], 40, 16) == 2   # at least one more than what fitted


def test_two_points_follow_their_line_and_stay_between_what_fitted_and_what_did_not():
    assert next_batch([Trial(1, True, 5), Trial(8, True, 26)], 40, 16) == 12  # (40 - 2) // 3
    assert next_batch([Trial(1, True, 5), Trial(13, False, 41)], 40, 16) == 12
    assert next_batch([Trial(1, True, 5), Trial(12, True, 38), Trial(13, False, 41)], 40, 16) is None
    assert next_batch([Trial(1, True, 5), Trial(4, False, 80)], 40, 16) == 2  # 1 + 35 // 25
    # a guess the line puts at or past a batch that failed moves below it; one at or below a batch that fitted, above
    assert next_batch([Trial(1, True, 5), Trial(3, False, 20)], 40, 16) == 2
    assert next_batch([Trial(1, True, 5), Trial(4, True, 39), Trial(8, False, 80)], 40, 16) == 5


def test_nothing_fits_when_one_image_does_not():
    assert next_batch([], 40, 8) == 1
    assert next_batch([Trial(1, False, 41)], 40, 8) is None
    assert best_batch([Trial(1, False, 41)], 8) == 0
    # a batch that did not fit (an explicit --batch_size) is no answer: one image is tried next
    assert next_batch([Trial(4, False, 60)], 40, 3) == 1


def test_best_batch_ignores_a_fit_above_a_failure():
    """Bytes that do not grow with the batch (a compiler's other layout) cannot make the search pick past a batch
    that failed."""
    trials = [Trial(1, True, 5), Trial(3, False, 41), Trial(4, True, 39)]
    assert best_batch(trials, 8) == 1 and next_batch(trials, 40, 8) is None


# ------------------------------------------------------------------------------------------------ the fastest batch
def test_the_fastest_batch_and_a_near_tie_goes_to_the_smaller():
    from model.preflight.batch_search import fastest

    assert fastest({1: 0.6666, 2: 0.6341, 4: 0.6524}) == 2
    assert fastest({1: 0.9306, 2: 0.9291}) == 1  # 0.16 % apart: a tie, the smaller batch
    assert fastest({1: 0.700, 2: 0.650, 4: 0.6499}) == 2  # a tie at the minimum: the smaller again
    assert fastest({2: 0.5, 8: 0.4}) == 8


@pytest.mark.parametrize("int8, measured, picked", [
    (True, {1: 0.6666, 2: 0.6341, 4: 0.6524}, 2),  # klein-4B, 1024x1024, 4 steps, one v5e chip
    (False, {1: 0.9306, 2: 0.9291}, 1),
])
def test_the_batch_terms_reproduce_the_chips_times_per_image(int8, measured, picked):
    """From the time at one image, the calibrated batch terms give the chip's times at the other batches (the
    compiler's figures per image barely change with the batch, as test_preflight's auto test checks), and the
    fastest of them is the one the chip measured fastest, or the smaller of a tie."""
    from model.preflight.batch_search import fastest
    from model.preflight.estimate import batch_term

    assert batch_term(1, int8=int8) == 0.0
    predicted = {b: measured[1] + batch_term(b, int8=int8) for b in (1, 2, 4, 8)}
    for b, seconds in measured.items():
        assert predicted[b] == pytest.approx(seconds, abs=2e-4), b
    assert fastest(predicted) == picked
