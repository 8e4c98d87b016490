"""Tables as text (for the terminal) and as HTML (for the report), with the same number formats.

Floats get three significant decimals; lists are joined with commas; nothing is truncated.
"""

from __future__ import annotations

import html
from typing import Any

import polars as pl


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def to_text(df: pl.DataFrame) -> str:
    """A markdown-style table, columns aligned, every row shown."""
    header = df.columns
    body = [[_cell(v) for v in row] for row in df.rows()]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(header)]
    numeric = [df.schema[c].is_numeric() for c in header]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in body)])


def to_html(df: pl.DataFrame) -> str:
    """An HTML <table>, values escaped, numbers right-aligned."""
    numeric = [df.schema[c].is_numeric() for c in df.columns]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    rows = []
    for row in df.rows():
        cells = "".join(f'<td class="{"num" if n else "txt"}">{html.escape(_cell(v))}</td>' for v, n in zip(row, numeric))
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
