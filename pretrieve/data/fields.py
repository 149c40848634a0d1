"""The field mapping of `prepare --fields KEY=COLUMN`: which column of a record holds a document's text, title,
id and pseudo-queries, or a pair's query, positives and negatives.

A column is a key of the record, a dotted path into nested columns (`passages.passage_text`: the struct column
`passages`, its field `passage_text`), or a list column masked by another (`passages.passage_text[passages.is_selected]`:
the items whose mask item is true; `[!passages.is_selected]`: those whose mask item is false). The mask is how
MS MARCO's `microsoft/ms_marco` names its judged passages among the retrieved ones.
"""

from __future__ import annotations

import re

TEXT_KEYS = ("text", "title", "id", "queries")  # documents (ReaderOptions: text_field, ...)
PAIR_KEYS = ("query", "pos", "neg")  # pairs (--pairs --pair-method records)
KEYS = TEXT_KEYS + PAIR_KEYS
MISSING = object()  # a column the record does not have

_MASKED = re.compile(r"(?P<path>[^\[\]]+)\[(?P<negate>!?)(?P<mask>[^\[\]]+)\]")


class FieldError(ValueError):
    """A `--fields` mapping that cannot be used; the message names the entry."""


def parse_fields(entries: list[str] | None) -> dict[str, str]:
    """{"text": "body", ...} of `--fields text=body title=name`; each key once, each column well formed."""
    mapping: dict[str, str] = {}
    for entry in entries or ():
        key, sep, column = entry.partition("=")
        key, column = key.strip(), column.strip()
        if not sep or not column:
            raise FieldError(f"--fields {entry!r}: write KEY=COLUMN, e.g. text=body")
        if key not in KEYS:
            raise FieldError(f"--fields {entry!r}: unknown key {key!r}; the keys are {', '.join(KEYS)}")
        if key in mapping:
            raise FieldError(f"--fields: {key} is mapped twice ({mapping[key]!r} and {column!r})")
        if "[" in column and not _MASKED.fullmatch(column):
            raise FieldError(f"--fields {entry!r}: a masked column is COLUMN[MASK] or COLUMN[!MASK]")
        mapping[key] = column
    return mapping


def field_value(record: dict, column: str):
    """The value of `column` in `record` (module docstring), or MISSING when the record has no such column; a
    mask that is not a list as long as its column is a FieldError naming both."""
    masked = _MASKED.fullmatch(column) if "[" in column else None
    if masked is None:
        return _path_value(record, column)
    values, mask = _path_value(record, masked["path"]), _path_value(record, masked["mask"])
    if values is MISSING or mask is MISSING:
        return MISSING
    if not isinstance(values, list) or not isinstance(mask, list) or len(values) != len(mask):
        raise FieldError(f"column {column!r}: {masked['path']} and {masked['mask']} must be lists of one length")
    keep = not masked["negate"]
    return [v for v, m in zip(values, mask) if bool(m) == keep]


def _path_value(record: dict, column: str):
    if column in record:  # a key that holds a dot itself comes first
        return record[column]
    value = record
    for name in column.split("."):
        if not isinstance(value, dict) or name not in value:
            return MISSING
        value = value[name]
    return value
