"""The flashinfer-bench comparison's shared dataset loads in flashinfer-bench 0.1.2 as fibray
loaded it, and its comparison counts agreements and latency ratios per (solution, workload)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from vs_flashinfer_bench import compare, prepare_dataset  # noqa: E402


def test_shared_dataset_loads_in_flashinfer_bench_with_the_same_contents(tmp_path: Path) -> None:
    from flashinfer_bench.data import TraceSet

    from fibray.dataset import load_dataset

    counts = prepare_dataset(REPO / "datasets" / "llm", "cpu_small", [], tmp_path / "data",
                             definitions=["rmsnorm_h4096", "gemm_n4096_k4096", "top_p_sampling_from_probs_v32000"])
    ts = TraceSet.from_path(str(tmp_path / "data"))
    ours = load_dataset(tmp_path / "data")  # and fibray reads the folder it wrote
    assert counts["definitions"] == len(ts.definitions) == len(ours.definitions) == 3
    assert counts["workloads"] == sum(len(v) for v in ts.workloads.values()) == sum(len(v) for v in ours.workloads.values())
    names = {s.name for v in ts.solutions.values() for s in v}
    assert names == set(ours.solutions) and len(names) == counts["solutions"]
    # c_abi CUDA solutions, which flashinfer-bench cannot load, are left out by language
    assert "rmsnorm_h4096_cuda_c_abi" not in names and "rmsnorm_h4096_triton" in names
    for d in ts.definitions.values():
        assert d.model_dump(mode="json")["name"] in ours.definitions


def test_compare_counts_agreement_and_latency_ratios() -> None:
    fibray_rows = [
        {"solution": "a", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 1.0},
        {"solution": "a", "workload_uuid": "w2", "status": "INCORRECT_NUMERICAL", "latency_ms": None},
        {"solution": "b", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 3.0},
        {"solution": "c", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 1.0},
    ]
    fib_rows = [
        {"solution": "a", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 2.0},
        {"solution": "a", "workload_uuid": "w2", "status": "PASSED", "latency_ms": 2.0},
        {"solution": "b", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 2.0},
    ]
    c = compare(fibray_rows, fib_rows)
    assert c["pairs"] == 3
    assert c["disagree"] == [(("a", "w2"), "INCORRECT_NUMERICAL", "PASSED")]
    assert c["only_fibray"] == [("c", "w1")] and c["only_fib"] == []
    assert sorted(c["latency_ratios"]) == [0.5, 1.5]
