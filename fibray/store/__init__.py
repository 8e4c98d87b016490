"""Append-only, hive-partitioned Parquet trace store and its readers."""

from fibray.store.columns import COLUMNS, LOOP_COLUMNS, PARTITION_COLUMNS, SCHEMA, to_row
from fibray.store.compact import CompactionResult, compact_partition, recover
from fibray.store.promotions import (
    PROMOTIONS_DIR, SERVING_STAGES, Gate, Outcome, PromotionLog, PromotionRecord, Stage, artifact_id,
)
from fibray.store.writer import StoreError, TraceStore, scan

__all__ = ["COLUMNS", "LOOP_COLUMNS", "PROMOTIONS_DIR", "SERVING_STAGES", "CompactionResult", "Gate", "Outcome", "PromotionLog",
           "PromotionRecord", "Stage", "artifact_id", "compact_partition", "recover", "PARTITION_COLUMNS", "SCHEMA",
           "StoreError", "TraceStore", "scan", "to_row"]
