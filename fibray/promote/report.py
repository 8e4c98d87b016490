"""The stage table: per definition, each artifact's stage and its latest verdict per gate."""

from __future__ import annotations

from collections.abc import Sequence

from fibray.store.promotions import AUTOMATED_GATES, Gate, Outcome, PromotionRecord

_CELL = {Outcome.PASSED: "passed", Outcome.FAILED: "FAILED", Outcome.NOT_RUN: "not_run"}
COLUMNS = ("solution", "artifact", "env", "stage", *(g.value for g in AUTOMATED_GATES), "review", "last")


def stage_rows(records: Sequence[PromotionRecord], here: str | None = None) -> dict[str, list[dict[str, str]]]:
    """Definition -> one row per artifact (rows in write order); `here`: this process's environment key."""
    history: dict[str, list[PromotionRecord]] = {}
    for r in records:
        history.setdefault(r.artifact_id, []).append(r)
    out: dict[str, list[dict[str, str]]] = {}
    for art, rows in history.items():
        last = rows[-1]
        cells = {"solution": last.solution, "artifact": art[:12],
                 "env": "here" if here is not None and last.environment_key == here else last.environment_key[:8],
                 "stage": last.stage.value, "review": "-"}
        for g in AUTOMATED_GATES:
            mine = [r for r in rows if r.gate is g]
            cells[g.value] = _CELL[mine[-1].outcome] if mine else "-"
        reviews = [r for r in rows if r.gate is Gate.REVIEW]
        if reviews:
            waived = reviews[-1].evidence.get("waived") or []
            cells["review"] = f"{reviews[-1].actor}" + (f" (waived {','.join(waived)})" if waived else "")
        cells["last"] = f"{last.gate.value}: {last.reason}"[:120]
        out.setdefault(last.definition, []).append(cells)
    return {d: sorted(rows, key=lambda c: c["solution"]) for d, rows in sorted(out.items())}


def format_stage_table(tables: dict[str, list[dict[str, str]]]) -> str:
    """The stage tables as aligned text, one block per definition."""
    if not tables:
        return "no promotion records"
    blocks = []
    for definition, rows in tables.items():
        widths = [max(len(h), *(len(r[h]) for r in rows)) for h in COLUMNS]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        blocks.append("\n".join([f"definition {definition}", fmt.format(*COLUMNS), fmt.format(*("-" * w for w in widths)),
                                 *(fmt.format(*(r[h] for h in COLUMNS)) for r in rows)]))
    return "\n\n".join(blocks)
