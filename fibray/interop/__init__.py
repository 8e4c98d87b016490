"""Interoperation with other tools' formats: FlashInfer Trace export of a store, and importers
(XPU-OJ problem packages, KernelBench tasks) that write FlashInfer Trace folders."""
