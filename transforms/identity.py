"""What makes an image that image: the one record an image's text, its manifest and sidecar rows and the
`--skip_existing` checks all write and read.

    ImageIdentity    one image: its request fingerprint (transforms/fingerprints.py, computed once on its task:
                     `ImageTask.request_fingerprint`) and the identity of the model that makes it
    ModelIdentity    the job's model, the same for every image: its fingerprint and the load settings it covers
                     that a reader wants named (dtype, quantization)

Every recorded field is a dataclass field of one of the two, and its metadata says how it is stored (the sidecar's
Parquet type) and whether a different recorded value makes an image stale by itself. Adding a field is one line
here: image text, manifest rows, sidecar columns and what a resume reads from earlier rows follow from
`RECORDED_FIELDS`. A job-wide field goes in ModelIdentity (its value is given where the job builds it,
pipeline/graph.py's SinkSettings); a field of each image, computed from its task, goes in ImageIdentity (its value
given in `ImageIdentity.of`). A field that changes pixels also belongs in what a fingerprint covers
(transforms/fingerprints.py), so a resume sees the change.

Pure: no Beam, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def recorded(arrow: str, *, decisive: bool = False, default: Any = None):
    """A recorded field: `arrow` is its sidecar column's pyarrow type name (string, int64, float64, bool_);
    `decisive`: a recorded value other than this image's makes the image stale (a fingerprint); the others are
    named parts of what a fingerprint covers, written for readers and never compared on their own."""
    return dataclasses.field(default=default, metadata={"arrow": arrow, "decisive": decisive})


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """The model a job's images are made by, as each of them records it."""

    model_fingerprint: str | None = recorded("string", decisive=True)  # None: a job that computed none (tests)
    dtype: str | None = recorded("string")  # None: recorded by a run before images named their dtype
    quantize: str = recorded("string", default="none")

    @classmethod
    def of(cls, value: "ModelIdentity | str | None") -> "ModelIdentity":
        """A ModelIdentity as it is, a bare model fingerprint (its other fields unknown), or None (nothing known)."""
        if isinstance(value, ModelIdentity):
            return value
        return cls(model_fingerprint=value or None)

    @classmethod
    def recorded_in(cls, fields: Mapping[str, Any]) -> "ModelIdentity":
        """The model identity an image's text or an earlier row records (absent fields: unknown)."""
        return cls(model_fingerprint=fields.get("model_fingerprint") or None, dtype=fields.get("dtype") or None,
                   quantize=fields.get("quantize") or "none")


@dataclasses.dataclass(frozen=True)
class ImageIdentity:
    """One image: the request it is made for and the model that makes it."""

    request_fingerprint: str = recorded("string", decisive=True)
    model: ModelIdentity = ModelIdentity()

    @classmethod
    def of(cls, task, model: ModelIdentity | str | None = None) -> "ImageIdentity":
        """The identity of `task`'s image made by `model` (the request fingerprint is the task's own, computed once)."""
        return cls(request_fingerprint=task.request_fingerprint, model=ModelIdentity.of(model))

    def fields(self) -> dict[str, Any]:
        """The recorded fields by name, in RECORDED_FIELDS order: what a manifest or sidecar row carries."""
        return {name: getattr(self.model if owner is ModelIdentity else self, name)
                for name, owner in _OWNERS.items()}

    def text(self) -> dict[str, str]:
        """The recorded fields as an image's text carries them: strings, and a field with no value left out."""
        return {name: str(value) for name, value in self.fields().items() if value is not None}

    def differs_from(self, recorded_fields: Mapping[str, Any]) -> str | None:
        """The first decisive field an earlier image or row records with another value than this image's, or
        None. A field the record lacks (written before it existed) or this image does not know is not compared."""
        mine = self.fields()
        for name in DECISIVE_FIELDS:
            theirs = recorded_fields.get(name)
            if theirs is not None and mine[name] is not None and str(theirs) != str(mine[name]):
                return name
        return None


def _recorded_fields(cls) -> dict[str, type]:
    return {f.name: cls for f in dataclasses.fields(cls) if "arrow" in f.metadata}


_OWNERS = {**_recorded_fields(ImageIdentity), **_recorded_fields(ModelIdentity)}
_METADATA = {f.name: f.metadata for cls in (ImageIdentity, ModelIdentity) for f in dataclasses.fields(cls)
             if "arrow" in f.metadata}
RECORDED_FIELDS = tuple(_OWNERS)  # request_fingerprint, model_fingerprint, dtype, quantize
DECISIVE_FIELDS = tuple(name for name in RECORDED_FIELDS if _METADATA[name]["decisive"])
ARROW_TYPES = {name: _METADATA[name]["arrow"] for name in RECORDED_FIELDS}  # sidecar column types, by name
