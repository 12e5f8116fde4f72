"""What a deployment asks to score each generated image with (JAX-free, like model.options).

    clip_score          100 x cos(image embedding, prompt embedding), floored at 0 (torchmetrics' CLIPScore)
    label:TEXT          the zero-shot probability of TEXT among the --score_labels (softmax of CLIP's logits)
    NAME                a head (--score_heads NAME=SOURCE) on the normalized image embedding

These names are the keys of each image's `scores` in the manifest, and what the filters (--min_score /
--max_score) name.
"""

from __future__ import annotations

import dataclasses
import re

CLIP_SCORE = "clip_score"
LABEL_PREFIX = "label:"
DEFAULT_SCORE_MODEL = "openai/clip-vit-large-patch14"  # CLIP ViT-L/14: what LAION's aesthetic predictor reads
HEAD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}\Z")


def label_score(label: str) -> str:
    """The score name of a zero-shot label."""
    return LABEL_PREFIX + label


@dataclasses.dataclass(frozen=True)
class ScoreSettings:
    """The CLIP checkpoint (`model`: local folder, gs:// or Hub id, in transformers' CLIPModel layout), the zero-shot
    `labels`, and the `heads` as (name, source of its safetensors file) pairs."""

    model: str
    labels: tuple[str, ...] = ()
    heads: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"the score model must be a non-empty path, gs:// URI or Hub id, got {self.model!r}")
        labels = tuple(str(label).strip() for label in self.labels)
        if any(not label for label in labels):
            raise ValueError(f"score labels must be non-empty texts, got {list(self.labels)!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"score labels must be distinct, got {list(labels)!r}")
        if len(labels) == 1:
            raise ValueError(f"zero-shot labels need at least two texts to choose between, got {list(labels)!r}")
        heads = tuple((str(n), str(s)) for n, s in self.heads)
        for name, source in heads:
            if not HEAD_NAME.match(name) or name == CLIP_SCORE:
                raise ValueError(f"a score head's name must be a letter then letters, digits, _ or - (and not "
                                 f"{CLIP_SCORE!r}), got {name!r}")
            if not source:
                raise ValueError(f"score head {name!r} has no source")
        if len({n for n, _ in heads}) != len(heads):
            raise ValueError(f"score head names must be distinct, got {[n for n, _ in heads]!r}")
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "heads", heads)

    @property
    def names(self) -> tuple[str, ...]:
        """Every score an image gets, in order: clip_score, the labels', the heads'."""
        return (CLIP_SCORE, *(label_score(x) for x in self.labels), *(n for n, _ in self.heads))


def parse_labels(text: str) -> tuple[str, ...]:
    """--score_labels "a photo,a drawing,nsfw content" -> the labels (empty pieces dropped)."""
    return tuple(p.strip() for p in str(text).split(",") if p.strip())


def parse_head(text: str) -> tuple[str, str]:
    """--score_heads NAME=SOURCE -> (name, source); ValueError naming the text otherwise."""
    name, sep, source = str(text).partition("=")
    if not sep or not name.strip() or not source.strip():
        raise ValueError(f"a score head is NAME=SOURCE (e.g. aesthetic=gs://bucket/aesthetic.safetensors), got "
                         f"{text!r}")
    return name.strip(), source.strip()
