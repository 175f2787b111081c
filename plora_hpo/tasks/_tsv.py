"""Reading GLUE's tab-separated files exactly as published.

The sentences contain ``"`` characters that are text, not quoting, so quoting is disabled;
MRPC starts with a UTF-8 byte order mark; CoLA's dev file has no final newline. Each quirk
would silently drop or merge rows with a default CSV reader.
"""

from __future__ import annotations

import csv
from pathlib import Path

from plora_hpo.errors import DataError


def read_tsv(path: Path, *, columns: int, header: tuple[str, ...] | None = None) -> list[list[str]]:
    """Rows of a GLUE TSV file; checks the header (if any) and that every row has ``columns`` fields."""
    with path.open(encoding="utf-8-sig", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    if header is not None:
        if not rows or tuple(rows[0]) != header:
            found = "\\t".join(rows[0]) if rows else "an empty file"
            raise DataError(
                f"{path}: unexpected header {found!r}; expected {chr(9).join(header)!r} (the original GLUE file)"
            )
        rows = rows[1:]
    first_data_line = 2 if header is not None else 1
    for offset, row in enumerate(rows):
        if len(row) != columns:
            raise DataError(
                f"{path}:{first_data_line + offset}: expected {columns} tab-separated fields, found {len(row)}; "
                "use the original GLUE file"
            )
    return rows
