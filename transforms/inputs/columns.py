"""Which column of a table (or key of a record) is which generation field, and which are extra columns.

`--prompt_column` (default `prompt`; matched exactly, else ignoring case) and `--id_column` (default `id`) name the
prompt and id columns; `--column_map old=new,...` renames columns to the other generation fields (`cfg` to
`guidance_scale`). Every other column is an extra column: it travels to the manifest row under `metadata`.
A table's header (or Parquet schema) is resolved once; JSONL and BigQuery records, whose keys may vary, per key set.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

# The fields of a generation request, as records name them.
FIELDS = ("prompt", "id", "seed", "height", "width", "num_inference_steps", "guidance_scale", "num_images",
          "reference_images", "lora")
# What --column_map may rename a column to (the prompt and id columns have their own options).
RENAMABLE = tuple(f for f in FIELDS if f not in ("prompt", "id"))


class ColumnError(ValueError):
    """Columns that cannot give requests: no prompt column, two columns for one field, a column named twice.
    `field` names the generation field at fault; `columns` are the columns the input has."""

    def __init__(self, reason: str, *, field: str | None = None, columns: Sequence[str] = ()):
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.columns = tuple(columns)


class MissingPromptColumn(ColumnError):
    """No column is the prompt column."""


def parse_column_map(text: str | None) -> tuple[tuple[str, str], ...]:
    """`old=new,old2=new2` -> ((old, new), ...); ValueError naming the entry that is not of that form or renames
    to something other than a generation field (the prompt and id columns have their own options)."""
    pairs: list[tuple[str, str]] = []
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        old, sep, new = entry.partition("=")
        old, new = old.strip(), new.strip()
        if not sep or not old or not new:
            raise ValueError(f"--column_map entry {entry.strip()!r} is not of the form old=new")
        if new in ("prompt", "id"):
            raise ValueError(f"--column_map entry {entry.strip()!r}: name the {new} column with --{new}_column")
        if new not in RENAMABLE:
            raise ValueError(f"--column_map entry {entry.strip()!r}: {new!r} is not one of {', '.join(RENAMABLE)}")
        if any(old == o for o, _ in pairs):
            raise ValueError(f"--column_map renames the column {old!r} twice")
        pairs.append((old, new))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """One set of columns resolved: {column: generation field} for the columns that are fields."""

    fields: Mapping[str, str]

    def split(self, record: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(values by generation field, extra columns by column name, in the record's order)."""
        named: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for column, value in record.items():
            field = self.fields.get(column)
            if field is None:
                extra[column] = value
            else:
                named[field] = value
        return named, extra


@dataclasses.dataclass(frozen=True)
class ColumnMap:
    """The job's column options: which column is the prompt, which the id, and renames to the other fields."""

    prompt_column: str = "prompt"
    id_column: str = "id"
    renames: tuple[tuple[str, str], ...] = ()

    def validate(self) -> "ColumnMap":
        """Raise ValueError naming the option when the options contradict each other."""
        for option, name in (("--prompt_column", self.prompt_column), ("--id_column", self.id_column)):
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"{option} must name a column, got {name!r}")
        if self.prompt_column == self.id_column:
            raise ValueError(f"--prompt_column and --id_column both name the column {self.prompt_column!r}")
        for old, _new in self.renames:
            if old in (self.prompt_column, self.id_column):
                raise ValueError(f"--column_map renames {old!r}, which is the prompt or id column")
        return self

    def known_names(self) -> tuple[str, ...]:
        """Every column name that means a generation field (for spotting a table's header in a text file)."""
        return tuple(dict.fromkeys(FIELDS + (self.prompt_column, self.id_column) + tuple(o for o, _ in self.renames)))

    def _exact(self) -> dict[str, str]:
        exact = {f: f for f in RENAMABLE}
        exact.update(self.renames)
        exact[self.id_column] = "id"
        exact[self.prompt_column] = "prompt"
        return exact

    def resolve(self, columns: Sequence[str], what: str = "the input") -> Resolved:
        """The fields of `columns` (a header, a schema, a record's keys); ColumnError when they cannot give a
        request. `what` names the columns' owner in the message ('the header', 'the record')."""
        columns = list(columns)
        repeated = [c for i, c in enumerate(columns) if c and c in columns[:i]]
        if repeated:
            raise ColumnError(f"{what} names the column {repeated[0]!r} more than once", field=repeated[0],
                              columns=columns)
        exact = self._exact()
        fields = {c: exact[c] for c in columns if c in exact}
        if "prompt" not in fields.values():
            folded = [c for c in columns if c.casefold() == self.prompt_column.casefold()]
            if len(folded) > 1:
                raise ColumnError(f"{what} has several columns named like the prompt column {self.prompt_column!r} "
                                  f"(ignoring case): {', '.join(map(repr, folded))}; set --prompt_column to one",
                                  field="prompt", columns=columns)
            if not folded:
                raise MissingPromptColumn(f"{what} has no prompt column {self.prompt_column!r} (--prompt_column); "
                                          f"its columns are: {_listed(columns)}", field="prompt", columns=columns)
            fields[folded[0]] = "prompt"
        by_field: dict[str, str] = {}
        for column, field in fields.items():
            if field in by_field:
                raise ColumnError(f"{what} has two columns for {field}: {by_field[field]!r} and {column!r} "
                                  f"(see --column_map, --prompt_column, --id_column)", field=field, columns=columns)
            by_field[field] = column
        return Resolved(fields)

    def unused_renames(self, columns: Iterable[str]) -> list[str]:
        """The --column_map sources that are not among `columns` (most likely a typo)."""
        present = set(columns)
        return [old for old, _ in self.renames if old not in present]


def _listed(columns: Sequence[str], most: int = 40) -> str:
    shown = ", ".join(repr(c) for c in columns[:most])
    more = f" and {len(columns) - most} more" if len(columns) > most else ""
    return (shown + more) if columns else "(none)"


class ColumnResolver:
    """`ColumnMap.resolve` for records whose keys may vary (JSONL, BigQuery), remembered per key set: most files
    repeat a handful of key sets, so a record costs one dictionary lookup. One per reader (not shared)."""

    _MOST = 256  # key sets remembered; a file with more distinct ones is resolved record by record past that

    def __init__(self, column_map: ColumnMap):
        self._map = column_map
        self._known: dict[tuple, Resolved | ColumnError] = {}

    def resolve(self, keys: Iterable[str]) -> Resolved | ColumnError:
        """The resolved columns, or the ColumnError saying why these keys cannot give a request (returned, not
        raised: one remembered error serves every record with those keys)."""
        key = tuple(keys)
        found = self._known.get(key)
        if found is None:
            try:
                found = self._map.resolve(key, "the record")
            except MissingPromptColumn as e:  # a record without a prompt, as a JSON record says it
                found = MissingPromptColumn(f"missing prompt: {e.reason}", field=e.field, columns=e.columns)
            except ColumnError as e:
                found = e
            if len(self._known) < self._MOST:
                self._known[key] = found
        return found
