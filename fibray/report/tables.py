"""Tables as text (for the terminal) and as HTML (for the report), with the same number formats.

Floats get three decimals; lists are joined with commas; a table longer than its limit
shows its first rows and says how many it left out.
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


TEXT_ROWS = 300
HTML_ROWS = 2000


def _more(df: pl.DataFrame, limit: int) -> str:
    return f"... {df.height - limit:,} more rows (of {df.height:,})" if df.height > limit else ""


def to_text(df: pl.DataFrame, limit: int = TEXT_ROWS) -> str:
    """A markdown-style table, columns aligned, at most `limit` rows."""
    header = df.columns
    body = [[_cell(v) for v in row] for row in df.head(limit).rows()]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(header)]
    numeric = [df.schema[c].is_numeric() for c in header]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    more = _more(df, limit)
    return "\n".join([line(header), rule, *(line(r) for r in body), *([more] if more else [])])


def to_html(df: pl.DataFrame, limit: int = HTML_ROWS) -> str:
    """An HTML <table> of at most `limit` rows, values escaped, numbers right-aligned."""
    numeric = [df.schema[c].is_numeric() for c in df.columns]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    rows = []
    for row in df.head(limit).rows():
        cells = "".join(f'<td class="{"num" if n else "txt"}">{html.escape(_cell(v))}</td>' for v, n in zip(row, numeric))
        rows.append(f"<tr>{cells}</tr>")
    more = _more(df, limit)
    return (f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            + (f"<p class='note'>{html.escape(more)}</p>" if more else ""))
