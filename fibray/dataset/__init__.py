"""Load and validate FlashInfer Trace dataset folders."""

from fibray.dataset.loader import Dataset, DatasetError, load_dataset, parse_model, read_json, read_jsonl
from fibray.dataset.splits import SPLITS_DIR, read_splits, split_files

__all__ = ["SPLITS_DIR", "Dataset", "DatasetError", "load_dataset", "parse_model", "read_json", "read_jsonl", "read_splits",
           "split_files"]
