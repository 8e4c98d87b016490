"""Load and validate FlashInfer Trace dataset folders."""

from fibray.dataset.loader import Dataset, DatasetError, load_dataset, parse_model, read_json, read_jsonl

__all__ = ["Dataset", "DatasetError", "load_dataset", "parse_model", "read_json", "read_jsonl"]
