"""Making datasets: the seeded LLM-serving trace generator behind datasets/llm (workload shapes,
paged and ragged batches, expert routing, sampling distributions). Loading lives in fibray.dataset."""

from fibray.generate.llm import CPU_SMALL, Draft, dedup, drafts_for, generate, main, write_definitions

__all__ = ["CPU_SMALL", "Draft", "dedup", "drafts_for", "generate", "main", "write_definitions"]
