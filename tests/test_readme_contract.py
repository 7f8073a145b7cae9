"""The README's result-record table and the record types in common/contracts.py say the same."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_type_hints

from genqueue.common.contracts import ErrorRecord, ResultRecord

README = Path(__file__).resolve().parent.parent / "README.md"


def table_fields() -> set[str]:
    text = README.read_text()
    start = text.index("### Result records")
    rows = [line for line in text[start:].splitlines()[1:60] if line.startswith("| `")]
    fields: set[str] = set()
    for row in rows:
        first = row.split("|")[1]
        fields |= set(re.findall(r"`([a-z_]+)`", first))
    return fields


def test_every_record_field_is_documented_and_nothing_else() -> None:
    typed = set(get_type_hints(ResultRecord)) | set(get_type_hints(ErrorRecord))
    documented = table_fields()
    assert typed - documented == set(), f"fields missing from the README table: {sorted(typed - documented)}"
    assert documented - typed == set(), f"README fields no record type has: {sorted(documented - typed)}"
