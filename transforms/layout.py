"""The job's output layout and row shapes, in one place (held-out checks read exactly this layout).

    {output}/images/{stem}.png               one image per request (num_images == 1); `stem` is the id itself when
                                             it is [A-Za-z0-9._-]{1,128} not starting with a dot, else a safe
                                             form of it with a short hash (`image_stem`)
    {output}/images/{stem}-{j}.png           image j of a request with num_images > 1
                                             (.webp / .jpg instead of .png with --image_format webp / jpeg)
    {output}/manifest/manifest-*.jsonl       one row per image written by this run
    {output}/manifest/existing-*.jsonl       one row per image this run found already there (--skip_existing);
                                             with manifest-*, every image of the job exactly once
    {output}/errors/errors-*.jsonl           one row per rejected record or failed image
    {output}/summary.json                    the run's figures
    {output}/metadata.jsonl                  (--output_format files) every image's manifest row, `file_name`
                                             relative to {output}: what `datasets` imagefolder reads
    {output}/shards/, dataset.json, sizes.json, README.md   (--output_format webdataset; see transforms/shards.py)
    {output}/preview/index.html, contact_sheet.jpg           (--preview N) a gallery of the first N images by id
    {output}/filtered/{stem}.png             (--min_score / --max_score) images a score filter left out of
                                             metadata.jsonl and the shards; their manifest rows say why

Pure functions only: no Beam, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from typing import Any

from .identity import RECORDED_FIELDS, ImageIdentity

IMAGES_DIR = "images"
FILTERED_DIR = "filtered"  # images a score filter left out of the dataset (transforms/score_filters.py)
MANIFEST_DIR = "manifest"
ERRORS_DIR = "errors"
MANIFEST_PREFIX = "manifest"
EXISTING_PREFIX = "existing"
ERRORS_PREFIX = "errors"
SUMMARY_FILE = "summary.json"
ROWS_SUFFIX = ".jsonl"

# The offending record is kept in an error row, cut to this many characters.
MAX_RECORD_CHARS = 1000

# Kinds of error rows.
INVALID_RECORD = "invalid_record"
DUPLICATE_ID = "duplicate_id"
FILE_NAME_COLLISION = "file_name_collision"  # two requests would write the same image file
UNREADABLE_INPUT = "unreadable_input"  # an input file that cannot be read (to its end)
INFERENCE_FAILED = "inference_failed"
INFERENCE_TIMEOUT = "inference_timeout"  # a batch ran past --inference_timeout_s (or waited on one that did)
INVALID_REFERENCE = "invalid_reference"  # a reference image that is missing, unreadable or unusable
NON_FINITE_IMAGE = "non_finite_image"  # generation gave NaN or inf values: nothing is written for that image
ERROR_KINDS = (INVALID_RECORD, DUPLICATE_ID, FILE_NAME_COLLISION, UNREADABLE_INPUT, INFERENCE_FAILED, INFERENCE_TIMEOUT,
               INVALID_REFERENCE, NON_FINITE_IMAGE)  # every kind above (the runbooks list them; tests check both)

MANIFEST_FIELDS = (
    "id",
    "file_name",
    "uri",
    "prompt",
    "prompt_truncated",
    "seed",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "model",
    "sha256",
    "bytes",
    "crc32c",  # of the stored bytes, as GCS lists it: --skip_existing keeps an image only when the object has it
    "generation_ms",
    "metadata",
    # transforms/identity.py: request_fingerprint, model_fingerprint (what --skip_existing compares, without reading
    # the image), dtype and quantize (none | int8) of the model that made it
    *RECORDED_FIELDS,
    "phash",  # transforms/phash.py: the pixels' 64-bit perceptual hash, an output beside the identity (None where an
    # older row has none)
)


# An id of this form is its images' file stem unchanged: the ids earlier versions accepted, whose outputs resume
# under the same names.
PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")
STEM_SLUG_CHARS = 64  # readable part of the stem of any other id
STEM_HASH_HEX = 12  # 48 bits of the id's sha256: two ids share a stem only by choice (a collision row says so)


def image_stem(request_id: str) -> str:
    """The file stem of a request's images: the id itself when it is a plain id (PLAIN_ID), else a safe readable
    form of it plus a hash of the exact id: letters and digits kept (accents dropped: 'café 1' -> 'cafe_1-<hash>'),
    every other run of characters one '_' (none at
    either end), no leading dot, at most 64 characters, then '-' and 12 hex digits of its
    sha256. Only [A-Za-z0-9._-] ever reaches a file name: no separator, no '..', no leading dot, no control
    character, no case-only difference between two ids' hashes, under 100 bytes; the same on every file system
    and on gs://."""
    if PLAIN_ID.match(request_id):
        return request_id
    ascii_text = unicodedata.normalize("NFKD", request_id).encode("ascii", "ignore").decode("ascii")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ascii_text).lstrip("._")[:STEM_SLUG_CHARS].rstrip("_")
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:STEM_HASH_HEX]
    return f"{slug}-{digest}" if slug else digest


def image_file_name(request_id: str, index: int, num_images: int) -> str:
    """The image's path relative to `{output}`: `images/{stem}.png`, or `images/{stem}-{j}.png` when
    num_images > 1 (`image_stem`: the id itself for a plain id)."""
    stem = image_stem(request_id)
    if num_images == 1:
        return f"{IMAGES_DIR}/{stem}.png"
    return f"{IMAGES_DIR}/{stem}-{index}.png"


# --image_format -> the extension of the stored image files.
IMAGE_EXTENSIONS = {"png": "png", "webp": "webp", "jpeg": "jpg"}
IMAGE_FORMATS = tuple(IMAGE_EXTENSIONS)  # --image_format choices
# zlib level 1 rather than Pillow's 6: faster in every row of benchmarks.host_path for files about 9% larger
# (docs/developers.md, "Host path"); the host's encoding time is what keeps the accelerator waiting.
DEFAULT_PNG_COMPRESS_LEVEL = 1
DEFAULT_QUALITY = 90  # --quality of the lossy formats (WebP, JPEG)


def stored_image_name(file_name: str, image_format: str = "png") -> str:
    """A task's file name (always `.png`, see `image_file_name`) as stored in `image_format`: same name, that
    format's extension; ValueError naming a format that is not one of IMAGE_EXTENSIONS."""
    if image_format not in IMAGE_EXTENSIONS:
        raise ValueError(f"image format {image_format!r} is not one of {sorted(IMAGE_EXTENSIONS)}")
    stem = file_name[:-len(".png")] if file_name.endswith(".png") else file_name
    return f"{stem}.{IMAGE_EXTENSIONS[image_format]}"


def is_local_path(path: str) -> bool:
    """Whether `path` is a local file path rather than a URI of an object store (gs://...)."""
    return "://" not in path


METADATA_FILE = "metadata.jsonl"  # what Hugging Face `imagefolder` looks for, at the root of a files output


def metadata_path(output: str) -> str:
    return join(output, METADATA_FILE)


def join(output: str, relpath: str) -> str:
    """`output` + a '/'-separated relative path; works for gs:// URIs and local folders alike."""
    if "://" in output:
        return output.rstrip("/") + "/" + relpath
    import os

    return os.path.join(output, *relpath.split("/"))


def images_glob(output: str, image_format: str = "png") -> str:
    """The stored images of `image_format` under `output` (what --skip_existing lists)."""
    return join(output, f"{IMAGES_DIR}/*.{IMAGE_EXTENSIONS[image_format]}")


def manifest_prefix(output: str) -> str:
    """Prefix handed to WriteToText: files come out as `manifest/manifest-SSSSS-of-NNNNN.jsonl`."""
    return join(output, f"{MANIFEST_DIR}/{MANIFEST_PREFIX}")


def existing_prefix(output: str) -> str:
    """Prefix of the rows for images a --skip_existing run found already written: `manifest/existing-*.jsonl`."""
    return join(output, f"{MANIFEST_DIR}/{EXISTING_PREFIX}")


def manifest_rows_glob(output: str) -> str:
    """Every manifest row file under `output` (manifest-* and existing-*): what --skip_existing reads."""
    return join(output, f"{MANIFEST_DIR}/*{ROWS_SUFFIX}")


def errors_prefix(output: str) -> str:
    return join(output, f"{ERRORS_DIR}/{ERRORS_PREFIX}")


def summary_path(output: str) -> str:
    return join(output, SUMMARY_FILE)


def truncate_record(record: Any, limit: int = MAX_RECORD_CHARS) -> str:
    """A record as text for an error row: strings as-is, anything else as compact JSON; cut to `limit` chars."""
    if isinstance(record, bytes):
        text = record.decode("utf-8", errors="backslashreplace")
    elif isinstance(record, str):
        text = record
    else:
        try:
            text = json.dumps(record, ensure_ascii=False, sort_keys=True, default=repr)
        except (TypeError, ValueError, RecursionError):
            text = _safe_repr(record)
    if len(text) > limit:
        text = text[:limit] + f"...[{len(text) - limit} more chars]"
    # A lone surrogate (JSON can spell one) has no UTF-8 form: show it escaped, so the row can always be written.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except (RecursionError, ValueError):  # too deep, or an int too long to print
        return f"<{type(value).__name__}>"


def _jsonable(value: Any, limit: int = 200) -> Any:
    """The offending value as it can be written in a row: itself when it is small JSON, else cut-down text."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return truncate_record(_safe_repr(value), limit)
    if len(text) > limit or not utf8_encodable(text):
        return truncate_record(text, limit)
    return value if not isinstance(value, str) else truncate_record(value, limit)


def writable_text(text: Any) -> Any:
    """`text` with a UTF-8 form: a lone surrogate (JSON can spell one; a local file name that is not UTF-8 has
    them) shown escaped, so that every row that names it can be encoded and written; anything not a string as
    it is."""
    if isinstance(text, str) and not utf8_encodable(text):
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def utf8_encodable(text: str) -> bool:
    """Whether `text` has a UTF-8 form (no lone surrogates, which JSON can spell): what every row file needs."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


_NO_VALUE = object()


def error_row(
    *,
    source: str,
    line: int | None,
    reason: str,
    record: Any = None,
    id: str | None = None,  # noqa: A002 - the row's field is called id
    field: str | None = None,
    value: Any = _NO_VALUE,
    kind: str = INVALID_RECORD,
    file_name: str | None = None,
) -> dict:
    """One errors-*.jsonl row. `source`, `line`, `id`, `reason`, `record` are the fixed fields; `kind`, `field`,
    `value` (the offending value) and `file_name` (for a failed image) are extra detail. Every text is made
    writable (`writable_text`), so that a row about a bad record can always be encoded and written."""
    row: dict[str, Any] = {
        "source": writable_text(source),
        "line": line if line is None or isinstance(line, int) else writable_text(str(line)),
        "id": writable_text(id) if id is None or isinstance(id, str) else truncate_record(id, 300),
        "reason": writable_text(reason),
        "record": None if record is None else truncate_record(record),
        "kind": kind,
    }
    if field is not None:
        row["field"] = writable_text(field) if isinstance(field, str) else truncate_record(field, 200)
    if value is not _NO_VALUE:
        row["value"] = _jsonable(value) if not isinstance(value, (str, bytes)) else truncate_record(value, 200)
    if file_name is not None:
        row["file_name"] = writable_text(file_name)
    return row


def manifest_row(
    task,
    *,
    file_name: str,
    uri: str,
    sha256: str,
    num_bytes: int,
    num_inference_steps: int,
    guidance_scale: float,
    prompt_truncated: bool | None,
    model: str,
    generation_ms: float | None,
    identity: ImageIdentity | None = None,
    key: str | None = None,
    crc32c: str | None = None,
    phash: str | None = None,
    scores: dict | None = None,
    filtered: dict | None = None,
) -> dict:
    """The manifest row of one image of `task` (an ImageTask): the one builder of manifest-*.jsonl, existing-*.jsonl,
    metadata.jsonl and KEY.json rows, for every sink. The request gives the id, prompt, seed, size, `metadata` (the
    record's extra columns, typed as read; {} when it had none), `reference_images` ([{uri, sha256}] in the
    record's order; the row has the key only when there are any) and `source`/`line`; the caller gives where the
    image is (`file_name`, `uri`), its bytes' sha256, size and CRC32C (transforms/checksums.py; None only where an
    older row did not record it), what its generate call reported (steps, guidance, truncation, model,
    `generation_ms`: None for an image found already written, whose time was not measured) and the image's
    `identity` (transforms/identity.py: its fields close the row; None: the task's, by an unknown model). `key`: the
    sample's key in a WebDataset shard, last."""
    r = task.request
    identity = identity or ImageIdentity.of(task)
    row = {
        "id": r.id,
        "file_name": file_name,
        "uri": uri,
        "prompt": r.prompt,
        "prompt_truncated": None if prompt_truncated is None else bool(prompt_truncated),
        "seed": int(task.seed),
        "height": int(r.height),
        "width": int(r.width),
        "num_inference_steps": int(num_inference_steps),
        "guidance_scale": float(guidance_scale),
        "model": model,
        "sha256": sha256,
        "bytes": int(num_bytes),
        "crc32c": crc32c,
        "generation_ms": None if generation_ms is None else round(float(generation_ms), 3),
        "metadata": dict(r.metadata_values()),
        **identity.fields(),
        "phash": phash,
    }
    if r.reference_images:
        row["reference_images"] = [{"uri": e["uri"], "sha256": e["sha256"]} for e in r.reference_entries()]
    if r.lora:  # the per-record LoRA adapter: {name, sha256, scale}
        row["lora"] = r.lora_entry()
    if r.source is not None:
        row["source"] = writable_text(r.source)  # a local file name that is not UTF-8, escaped
        row["line"] = r.line
    if scores is not None:  # --score_model: the image's scores, and the filter it broke (None: in the dataset)
        row["scores"] = {k: _score_value(v) for k, v in scores.items()}
        row["filtered"] = None if filtered is None else dict(filtered, value=_score_value(filtered.get("value")))
    if key is not None:
        row["key"] = key
    return row


def _score_value(value) -> float | None:
    """A score as rows hold it: 6 decimals (float32's precision), None for a missing or NaN one."""
    return None if value is None or value != value else round(float(value), 6)


def filtered_file_name(file_name: str) -> str:
    """Where a filtered image goes: `images/x.png` -> `filtered/x.png` (a shard key's `KEY.png` -> `filtered/KEY.png`)."""
    prefix = IMAGES_DIR + "/"
    return f"{FILTERED_DIR}/{file_name[len(prefix):] if file_name.startswith(prefix) else file_name}"


def to_json_line(row: dict) -> str:
    """A row as one JSON line (UTF-8 kept readable; NaN never written). A text without a UTF-8 form, which no
    row should hold, is written \\u-escaped (valid JSON) rather than failing the file it goes to."""
    text = json.dumps(row, ensure_ascii=False, sort_keys=False, allow_nan=False)
    return text if utf8_encodable(text) else json.dumps(row, ensure_ascii=True, sort_keys=False, allow_nan=False)
