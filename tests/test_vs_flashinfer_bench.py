"""The flashinfer-bench comparison's shared dataset loads in flashinfer-bench 0.1.2 as fibray
loaded it, and its comparison counts agreements and latency ratios per (solution, workload)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from vs_flashinfer_bench import compare, measurement_floor, prepare_dataset  # noqa: E402


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


def test_the_measurement_floor_counts_passed_candidates_and_each_timed_reference_once() -> None:
    rows = [
        {"solution": "a", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 1.0, "reference_latency_ms": 4.0},
        {"solution": "b", "workload_uuid": "w1", "status": "PASSED", "latency_ms": 3.0, "reference_latency_ms": 4.0},
        {"solution": "c", "workload_uuid": "w1", "status": "INCORRECT_NUMERICAL", "latency_ms": None,
         "reference_latency_ms": None},
        {"solution": "a", "workload_uuid": "w2", "status": "RUNTIME_ERROR", "latency_ms": None, "reference_latency_ms": None},
    ]
    fl = measurement_floor(rows, timed_calls=150, flush_ms=0.02)
    assert (fl["candidates"], fl["references"]) == (2, 1)
    assert abs(fl["kernels_s"] - 150 * (1.0 + 3.0 + 4.0) / 1e3) < 1e-12
    assert abs(fl["flushes_s"] - 150 * 3 * 0.02 / 1e3) < 1e-12
    assert fl["floor_s"] == fl["kernels_s"] + fl["flushes_s"]


def test_a_larger_dataset_gets_new_shapes_within_the_range_and_loads_in_both_tools(tmp_path: Path) -> None:
    from flashinfer_bench.data import TraceSet

    from fibray.dataset import load_dataset

    counts = prepare_dataset(REPO / "datasets" / "core", "gpu", [REPO / "solutions"], tmp_path / "data",
                             definitions=["gemm_n128_k2048", "rmsnorm_h4096"], workloads_per_definition=12)
    assert counts["workloads"] == 24
    ts = TraceSet.from_path(str(tmp_path / "data"))
    ours = load_dataset(tmp_path / "data")
    given = load_dataset(REPO / "datasets" / "core", definitions=["gemm_n128_k2048"], workload_set="gpu")
    for name, axis in (("gemm_n128_k2048", "M"), ("rmsnorm_h4096", "batch_size")):
        ws = ours.workloads[name]
        assert len(ws) == len(ts.workloads[name]) == 12
        assert len({w.uuid for w in ws}) == 12 and len({w.axes[axis] for w in ws}) == 12
        if name == "gemm_n128_k2048":
            values = [w.axes["M"] for w in given.workloads[name]]
            assert {w.uuid for w in given.workloads[name]} <= {w.uuid for w in ws}  # its own are kept
            assert all(min(values) <= w.axes["M"] <= max(values) for w in ws)
    again = prepare_dataset(REPO / "datasets" / "core", "gpu", [REPO / "solutions"], tmp_path / "again",
                            definitions=["gemm_n128_k2048"], workloads_per_definition=12)
    assert again["workloads"] == 12
    assert (tmp_path / "again" / "workloads" / "gemm" / "gemm_n128_k2048.jsonl").read_text() == \
        (tmp_path / "data" / "workloads" / "gemm" / "gemm_n128_k2048.jsonl").read_text()  # same seed, same shapes
