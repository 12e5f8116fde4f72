"""Prompt templates: `*.template.json` (or `.yaml`) files whose every combination of slot values is one record.

    {"template": "a photo of a {object} in {place}, {style}",
     "slots": {"object": ["cat", "dog"], "place": {"file": "places.txt"},
               "style": {"table": "styles.csv", "column": "name"}},
     "samples": 1000, "seed": 7, "id_prefix": "pets-", "parameters": {"height": 512, "width": 512}}

A vocabulary is a list, a text file (one value per line, blank lines skipped; relative to the template file, or
gs://) or a column of a table (CSV, TSV, Parquet or JSONL). Combination i of N is read off i in mixed radix (the
last slot turning fastest), so any record can be made from its index alone: the expansion never holds the product.
`samples` takes a seeded subset without repetition: the first `samples` positions of a keyed permutation of
[0, N) (a Feistel network with cycle walking), again one index at a time. A record's id is the digest of its slot
values (with the optional `id_prefix`), the same on every run, and its slot values are its labels (its metadata).
Everything wrong with a template is one TemplateError at launch, naming the slot, value or count.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
import posixpath
import string
from typing import Any, Iterator, Mapping

TEMPLATE_FORMAT = "template"
TEMPLATE_SUFFIXES = (".template.json", ".template.yaml", ".template.yml")
PARAMETERS = ("height", "width", "num_inference_steps", "guidance_scale", "num_images")
KEYS = ("template", "slots", "samples", "seed", "id_prefix", "parameters")
ID_HEX = 20
FEISTEL_ROUNDS = 4


class TemplateError(ValueError):
    """A template that cannot give records: what is wrong, naming the offending slot, value or count (`value`)."""

    def __init__(self, message: str, value: Any = None):
        super().__init__(message)
        self.value = value


def is_template(path: str, input_format: str | None = None) -> bool:
    """Whether an input is a template: `--input_format=template`, or a name ending .template.json/.yaml/.yml."""
    if input_format == TEMPLATE_FORMAT:
        return True
    return path.lower().endswith(TEMPLATE_SUFFIXES)


def slot_names(template: str) -> list[str]:
    """The slots a template text names, in order of first use; TemplateError for a field that is not a plain name
    ('{a.b}', '{0}', '{}', a format spec)."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise TemplateError(f"template {template!r} is not valid: {e} (write a literal brace as '{{{{' or '}}}}')",
                            template) from None
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if not field.isidentifier() or spec or conversion:
            raise TemplateError(f"template slot {{{field}{'!' + conversion if conversion else ''}"
                                f"{':' + spec if spec else ''}}} is not a plain name such as {{object}}", field)
        if field not in names:
            names.append(field)
    return names


@dataclasses.dataclass(frozen=True)
class Template:
    """A checked template: its text, each slot's vocabulary (in the order the slots are listed), how many records it
    gives (`count`), and what every record shares (`parameters`)."""

    source: str
    text: str
    slots: tuple[tuple[str, tuple[str, ...]], ...]
    samples: int | None = None
    seed: int = 0
    id_prefix: str = ""
    parameters: tuple[tuple[str, Any], ...] = ()

    @property
    def combinations(self) -> int:
        return math.prod(len(values) for _, values in self.slots)

    @property
    def count(self) -> int:
        """Records the template gives: `samples`, or every combination."""
        return self.combinations if self.samples is None else self.samples

    def combination(self, index: int) -> dict[str, str]:
        """The slot values of combination `index` (0 <= index < combinations): mixed radix, last slot fastest."""
        values = {}
        for name, vocabulary in reversed(self.slots):
            index, digit = divmod(index, len(vocabulary))
            values[name] = vocabulary[digit]
        return {name: values[name] for name, _ in self.slots}

    def index_at(self, position: int) -> int:
        """The combination index of the template's record number `position` (0 <= position < count)."""
        if self.samples is None:
            return position
        return permuted(position, self.combinations, self.seed)

    def record(self, position: int) -> tuple[str, str, dict[str, str]]:
        """Record number `position`: (its id, its prompt, its slot values)."""
        labels = self.combination(self.index_at(position))
        return record_id(labels, self.id_prefix), self.text.format_map(labels), labels


def record_id(labels: Mapping[str, str], prefix: str = "") -> str:
    """A record's id from its slot values alone: the same values give the same id on every run."""
    canonical = json.dumps(labels, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return prefix + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:ID_HEX]


# ------------------------------------------------------------------------------------------------ seeded sampling
def _round(value: int, key: int, rnd: int, bits: int) -> int:
    digest = hashlib.blake2b(f"{key}/{rnd}/{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << bits) - 1)


def permuted(position: int, size: int, seed: int) -> int:
    """Position `position` of a permutation of [0, size) keyed by `seed`: a balanced Feistel network over the
    smallest even power of two >= size, walked again while it lands outside [0, size). A bijection, so the first k
    positions are k distinct indices, each found without the others."""
    if not 0 <= position < size:
        raise ValueError(f"position {position} is outside [0, {size})")
    half = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    value = position
    while True:
        left, right = value >> half, value & mask
        for rnd in range(FEISTEL_ROUNDS):
            left, right = right, left ^ _round(right, seed, rnd, half)
        value = (left << half) | right
        if value < size:
            return value


# ------------------------------------------------------------------------------------------------ reading
def parse_template(data: bytes, source: str) -> dict:
    """A template file's bytes -> its object (JSON, or YAML for .yaml/.yml); TemplateError when it is neither."""
    text = data.decode("utf-8-sig")
    try:
        if source.lower().endswith((".yaml", ".yml")):
            import yaml

            obj = yaml.safe_load(text)
        else:
            obj = json.loads(text)
    except Exception as e:  # noqa: BLE001 - JSON and YAML syntax errors alike
        raise TemplateError(f"{source} is not a valid template file: {e}", source) from None
    if not isinstance(obj, dict):
        raise TemplateError(f"{source} must hold one object with 'template' and 'slots', got {type(obj).__name__}",
                            source)
    return obj


def _read(path: str) -> bytes:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as f:
        return f.read()


def resolve_path(path: str, template_source: str) -> str:
    """A vocabulary's file as given: absolute, gs:// or relative to the template file's folder."""
    if "://" in path or posixpath.isabs(path):
        return path
    return posixpath.join(posixpath.dirname(template_source), path)


def decode_text(data: bytes) -> str:
    """A vocabulary's bytes as text: UTF-16/UTF-32 by their byte-order mark (transforms/inputs/encodings.py, as
    the line readers take them), else UTF-8 with or without its own mark."""
    from .encodings import BOMS

    for bom, codec in BOMS:
        if data.startswith(bom):
            return data[len(bom):].decode(codec)
    return data.decode("utf-8-sig")


def _text_values(data: bytes, path: str) -> list[str]:
    return [line.strip() for line in decode_text(data).splitlines() if line.strip()]


def _column_values(data: bytes, path: str, column: str) -> list[str]:
    """One column of a table (CSV/TSV with a header, Parquet, JSONL), its empty cells skipped."""
    name = path.lower()
    if name.endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        if column not in table.column_names:
            raise TemplateError(f"{path} has no column {column!r} (its columns: {table.column_names})", column)
        cells = table.column(column).to_pylist()
    elif name.endswith((".jsonl", ".ndjson", ".json")):
        cells = [json.loads(line).get(column) for line in decode_text(data).splitlines() if line.strip()]
    else:
        dialect = "excel-tab" if name.endswith((".tsv", ".tab")) else "excel"
        rows = csv.DictReader(io.StringIO(decode_text(data)), dialect=dialect)
        if column not in (rows.fieldnames or []):
            raise TemplateError(f"{path} has no column {column!r} (its header: {rows.fieldnames})", column)
        cells = [row.get(column) for row in rows]
    return [str(c).strip() for c in cells if c is not None and str(c).strip()]


def vocabulary(name: str, spec: Any, source: str, read=_read) -> tuple[str, ...]:
    """Slot `name`'s values from its spec (a list, {'file': path} or {'table': path, 'column': name}), checked: at
    least one, no value twice (two records would share an id)."""
    if isinstance(spec, list):
        values = [v if isinstance(v, str) else json.dumps(v) for v in spec]
    elif isinstance(spec, dict) and set(spec) == {"file"}:
        path = resolve_path(str(spec["file"]), source)
        values = _text_values(_read_vocabulary(read, path, name), path)
    elif isinstance(spec, dict) and set(spec) == {"table", "column"}:
        path = resolve_path(str(spec["table"]), source)
        values = _column_values(_read_vocabulary(read, path, name), path, str(spec["column"]))
    else:
        raise TemplateError(f"slot {name!r}: a vocabulary is a list, {{\"file\": PATH}} or {{\"table\": PATH, "
                            f"\"column\": NAME}}, got {json.dumps(spec)[:200]}", name)
    if not values:
        raise TemplateError(f"slot {name!r} has an empty vocabulary", name)
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise TemplateError(f"slot {name!r} lists {value!r} twice (its records would share an id)", value)
        seen.add(value)
    return tuple(values)


def _read_vocabulary(read, path: str, name: str) -> bytes:
    try:
        return read(path)
    except TemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing or unreadable vocabulary file
        raise TemplateError(f"slot {name!r}: vocabulary file {path} cannot be read: {e}", path) from None


def build_template(obj: Mapping[str, Any], source: str, read=_read) -> Template:
    """A template file's object -> a checked Template; TemplateError naming what is wrong."""
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise TemplateError(f"{source}: unknown key {unknown[0]!r} (a template has {', '.join(KEYS)})", unknown[0])
    text, slots = obj.get("template"), obj.get("slots")
    if not isinstance(text, str) or not text.strip():
        raise TemplateError(f"{source}: 'template' must be a non-empty text, got {text!r}", text)
    if not isinstance(slots, dict) or not slots:
        raise TemplateError(f"{source}: 'slots' must be an object of vocabularies, got {slots!r}", slots)
    used = slot_names(text)
    for name in used:
        if name not in slots:
            raise TemplateError(f"{source}: slot {{{name}}} of the template is not in 'slots' "
                                f"(slots: {', '.join(slots)})", name)
    for name in slots:
        if name not in used:
            raise TemplateError(f"{source}: vocabulary {name!r} is never used in the template {text!r}", name)
    vocabularies = tuple((name, vocabulary(name, spec, source, read)) for name, spec in slots.items())
    parameters = obj.get("parameters") or {}
    if not isinstance(parameters, dict) or set(parameters) - set(PARAMETERS):
        raise TemplateError(f"{source}: 'parameters' may set {', '.join(PARAMETERS)}, got {parameters!r}",
                            parameters)
    template = Template(source=source, text=text, slots=vocabularies, seed=_integer(obj, "seed", 0, source),
                        id_prefix=str(obj.get("id_prefix") or ""), parameters=tuple(sorted(parameters.items())))
    samples = obj.get("samples")
    if samples is not None:
        samples = _integer(obj, "samples", None, source)
        if not 1 <= samples <= template.combinations:
            raise TemplateError(f"{source}: 'samples' must be from 1 to the {template.combinations} combinations, "
                                f"got {samples}", samples)
        template = dataclasses.replace(template, samples=samples)
    return template


def _integer(obj: Mapping[str, Any], key: str, default, source: str):
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TemplateError(f"{source}: {key!r} must be a whole number >= 0, got {value!r}", value)
    return value


def load_template(path: str, read=_read) -> Template:
    """Read and check the template at `path` (local or gs://) and its vocabularies."""
    return build_template(parse_template(_read_vocabulary(read, path, "template"), path), path, read)


def check_total(templates: list[Template], num_images_default: int, max_images: int | None) -> int:
    """The images the templates would give (records x num_images); TemplateError with the count when that is more
    than --max_images."""
    total = sum(t.count * int(dict(t.parameters).get("num_images", num_images_default)) for t in templates)
    if max_images is not None and total > max_images:
        names = ", ".join(f"{t.source} ({t.count} records)" for t in templates)
        raise TemplateError(f"the templates give {total} images ({names}), above --max_images={max_images}; "
                            f"set 'samples', or raise --max_images", total)
    return total


def chunks(count: int, size: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of at most `size` covering [0, count)."""
    for start in range(0, count, size):
        yield start, min(count, start + size)
