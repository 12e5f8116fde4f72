"""The score filters (--min_score / --max_score): which scored images leave the dataset, and why.

A rule names a score (model.config.score_settings: clip_score, label:TEXT, a head's name) and a threshold. An image
breaking any rule is *filtered*: it is stored under `filtered/` (files layout), left out of metadata.jsonl and the
shards, and its manifest row keeps everything with a `filtered` field naming the score, its value and the threshold
(the first rule it breaks, in the order given). Pure functions: no Beam, no I/O.
"""

from __future__ import annotations

import dataclasses
import math

MIN, MAX = "min", "max"


@dataclasses.dataclass(frozen=True)
class ScoreRule:
    """`score` must be at least (MIN) or at most (MAX) `threshold`."""

    score: str
    bound: str
    threshold: float

    @property
    def text(self) -> str:
        """The rule as summary.json counts it: 'clip_score>=22', 'label:nsfw content<=0.5'."""
        return f"{self.score}{'>=' if self.bound == MIN else '<='}{self.threshold:g}"

    def broken_by(self, value: float) -> bool:
        if value is None or math.isnan(value):
            return True  # a score that could not be computed never passes a filter silently
        return value < self.threshold if self.bound == MIN else value > self.threshold


def parse_rule(text: str, bound: str) -> ScoreRule:
    """--min_score clip_score=22 / --max_score "label:nsfw content=0.5" -> a rule (the last '=' splits, so a label
    may hold one); ValueError naming the option and the text otherwise."""
    flag = "--min_score" if bound == MIN else "--max_score"
    name, sep, value = str(text).rpartition("=")
    try:
        threshold = float(value)
    except ValueError:
        threshold = math.nan
    if not sep or not name.strip() or not math.isfinite(threshold):
        raise ValueError(f"{flag} takes SCORE=THRESHOLD (e.g. clip_score=22 or 'label:nsfw content=0.5'), got "
                         f"{text!r}")
    return ScoreRule(name.strip(), bound, threshold)


def parse_rules(min_scores, max_scores) -> tuple[ScoreRule, ...]:
    """Every rule of the repeated --min_score and --max_score options, mins first, each in the order given."""
    return (tuple(parse_rule(t, MIN) for t in min_scores or ())
            + tuple(parse_rule(t, MAX) for t in max_scores or ()))


def check_rules(rules, score_names) -> None:
    """ValueError for a rule naming a score that no image gets (a typo, a label not in --score_labels)."""
    for rule in rules:
        if rule.score not in score_names:
            raise ValueError(f"the score filter {rule.text!r} names {rule.score!r}, which is not one of the scores "
                             f"this job computes: {', '.join(score_names)}")


def first_broken(scores: dict, rules) -> dict | None:
    """The manifest's `filtered` field for an image with `scores`: {score, value, threshold, rule} of the first rule
    it breaks, or None when it passes them all."""
    for rule in rules:
        value = scores.get(rule.score)
        if rule.broken_by(value):
            shown = None if value is None or math.isnan(value) else value
            return {"score": rule.score, "value": shown, "threshold": rule.threshold, "rule": rule.text}
    return None


def apply_rules(generated, rules):
    """A GeneratedImage with its `filtered` field set from its scores (unchanged without scores or rules)."""
    if not rules or generated.scores is None:
        return generated
    return dataclasses.replace(generated, filtered=first_broken(generated.scores, rules))
