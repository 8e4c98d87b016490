"""The shared artifact cache: one compile per key across processes, failures cached, waits bounded."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fibray.compile import BuildError
from fibray.compile.cache import ArtifactCache, BuildLockTimeout, compile_ahead
from fibray.schema import Solution

_KERNEL = r"""
#include <stdint.h>
__global__ void fill(float* y, float v, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = v;
}
extern "C" void run_kernel(double value, void* y, int64_t n) {
  fill<<<(unsigned)((n + 255) / 256), 256>>>(static_cast<float*>(y), (float)value, n);
}
"""


def _solution(name: str, content: str = _KERNEL) -> Solution:
    return Solution.model_validate({
        "name": name, "definition": "fill", "author": "test",
        "spec": {"language": "cuda", "target_hardware": ["cuda"], "entry_point": "k.cu::run_kernel", "binding": "c_abi"},
        "sources": [{"path": "k.cu", "content": content}],
    })


_CHILD = r"""
import json, sys, time
from pathlib import Path
from fibray.compile.cache import ArtifactCache
from fibray.schema import Solution
root, sol_json, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
solution = Solution.model_validate_json(sol_json)
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
r = ArtifactCache(root).ensure(solution)
print(json.dumps({"compiled_here": r.compiled_here, "status": r.entry.status, "path": str(r.path),
                  "builder": r.entry.builder, "pid": __import__("os").getpid()}))
"""


@pytest.mark.slow
def test_two_processes_compiling_the_same_solution_at_once_compile_it_once(tmp_path: Path) -> None:
    sol, go = _solution("fill_shared"), tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "cache"), sol.model_dump_json(), str(go)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(2.0)  # both have imported fibray and are spinning on the start line
    go.touch()
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert sorted(r["compiled_here"] for r in results) == [False, True]
    assert results[0]["path"] == results[1]["path"]
    compiler = next(r for r in results if r["compiled_here"])
    assert compiler["builder"].endswith(f":{compiler['pid']}")  # the entry names the one process that compiled
    assert len(list((tmp_path / "cache").glob("*/entry.json"))) == 1
    assert not list((tmp_path / "cache" / ".tmp").iterdir())  # nothing half-written left behind


def test_failed_compile_is_cached_with_its_log_and_not_retried(tmp_path: Path) -> None:
    broken = _solution("fill_broken", _KERNEL.replace("y[i] = v;", "y[i] = v"))
    first = ArtifactCache(tmp_path).ensure(broken)
    assert first.compiled_here and (first.entry.status, first.entry.reason) == ("failed", "nvcc_error")
    assert "expected a \";\"" in first.entry.message
    t0 = time.monotonic()
    second = ArtifactCache(tmp_path).ensure(broken)  # another worker, later
    assert not second.compiled_here and time.monotonic() - t0 < 2.0
    assert (second.entry.message, second.entry.reason) == (first.entry.message, first.entry.reason)
    with pytest.raises(BuildError) as e:
        ArtifactCache(tmp_path).artifact(broken)
    assert (e.value.reason, str(e.value)) == ("nvcc_error", first.entry.message)


def test_waiting_for_a_held_build_lock_gives_up_at_the_deadline(tmp_path: Path) -> None:
    sol = _solution("fill_locked")
    cache = ArtifactCache(tmp_path, lock_deadline_s=0.5, poll_s=0.05)
    lock = tmp_path / ".locks" / f"{cache.key(sol)}.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another worker is compiling this key and never finishes
        t0 = time.monotonic()
        with pytest.raises(BuildLockTimeout):
            cache.ensure(sol)
        assert 0.5 <= time.monotonic() - t0 < 5
    finally:
        os.close(fd)
    assert cache.lookup(sol) is None  # a timeout is not a verdict: nothing was cached


def test_cache_key_changes_with_the_target_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sol, cache = _solution("fill_arch"), ArtifactCache(tmp_path)
    default = cache.key(sol)
    monkeypatch.setenv("FIBRAY_CUDA_ARCH", "100a")
    assert cache.key(sol) != default


@pytest.mark.slow
def test_compile_ahead_returns_the_error_text_or_none(tmp_path: Path) -> None:
    assert compile_ahead(_solution("fill_ok"), tmp_path) is None
    text = compile_ahead(_solution("fill_bad", _KERNEL.replace("int64_t n)", "int64_t n")), tmp_path)
    assert text is not None and "nvcc failed" in text
    python = Solution.model_validate({
        "name": "py", "definition": "fill", "author": "test",
        "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "m.py::run"},
        "sources": [{"path": "m.py", "content": "def run(x):\n    return x\n"}],
    })
    assert compile_ahead(python, tmp_path) is None  # nothing to compile
