"""Append-only, hive-partitioned Parquet trace store and its readers."""

from fibray.store.columns import COLUMNS, LOOP_COLUMNS, PARTITION_COLUMNS, SCHEMA, to_row
from fibray.store.promotions import (
    PROMOTIONS_DIR, SERVING_STAGES, Gate, Outcome, PromotionLog, PromotionRecord, Stage, artifact_id,
)
from fibray.store.writer import StoreError, TraceStore, scan

_COMPACT = ("CompactionResult", "compact_partition", "recover")


def __getattr__(name: str) -> object:
    # fibray.store.compact is also a command (python -m fibray.store.compact): importing it here at once
    # would make runpy warn that the module was already imported before it ran
    if name in _COMPACT:
        from fibray.store import compact

        return getattr(compact, name)
    raise AttributeError(f"module 'fibray.store' has no attribute {name!r}")

__all__ = ["COLUMNS", "LOOP_COLUMNS", "PROMOTIONS_DIR", "SERVING_STAGES", "CompactionResult", "Gate", "Outcome", "PromotionLog",
           "PromotionRecord", "Stage", "artifact_id", "compact_partition", "recover", "PARTITION_COLUMNS", "SCHEMA",
           "StoreError", "TraceStore", "scan", "to_row"]
