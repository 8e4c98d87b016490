"""The catalogue of reasons: README's table repeats it, and every expected reason is in it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fibray.schema.reasons import FAULT_REASONS, POISONING_REASONS, Reason, describe

REPO = Path(__file__).resolve().parents[1]
_ROW = re.compile(r"^\| `([a-z_]+)` \| (.*) \|$")


def _readme_table() -> dict[str, str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Statuses and reasons", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for line in section.splitlines() if (m := _ROW.match(line))}


def test_every_reason_has_a_one_line_docstring() -> None:
    docs = describe()
    assert set(docs) == set(Reason)
    assert all(doc and "\n" not in doc for doc in docs.values())


def test_readme_table_equals_the_catalogue() -> None:
    expected = {reason.value: doc for reason, doc in describe().items()}
    table = _readme_table()
    if table != expected:
        rows = "\n".join(f"| `{k}` | {v} |" for k, v in expected.items())
        raise AssertionError(f"README's table of reasons differs from fibray.schema.reasons.Reason; it should read:\n{rows}")


def test_every_expected_fault_reason_is_in_the_catalogue() -> None:
    files = sorted((REPO / "tests").glob("fault_expectations*.json"))
    assert files
    for path in files:
        for candidate, (status, reason, *_) in json.loads(path.read_text()).items():
            assert reason is None or reason in set(Reason), f"{path.name}: {candidate}: reason {reason!r} is not a Reason"


def test_reason_groups_are_catalogue_members() -> None:
    assert POISONING_REASONS <= FAULT_REASONS
    assert all(isinstance(r, Reason) for r in FAULT_REASONS)
    assert Reason.RUN_TIMEOUT == "run_timeout"  # a member is its string: stored rows stay plain strings


def test_every_designed_smoke_reason_is_in_the_catalogue() -> None:
    from _sweep_helpers import DESIGNED

    assert all(reason is None or reason in set(Reason) for _, reason in DESIGNED.values())


_TORCH_HINT = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
               "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
               "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def test_a_cuda_error_is_classified_by_its_error_not_by_torchs_hint() -> None:
    """torch ends every CUDA error with a hint that mentions device-side assertions: only a real
    assert is `device_assert` (an H100 judged a candidate that broke its driver's pipes so)."""
    from fibray.evaluate.candidate import classify_exception

    broken = RuntimeError("CUDA error: OS call failed or operation not supported on this OS\nSearch for "
                          "`cudaErrorOperatingSystem' in https://docs.nvidia.com/cuda/ for more information." + _TORCH_HINT)
    asserted = RuntimeError("CUDA error: device-side assert triggered" + _TORCH_HINT)
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered" + _TORCH_HINT)
    assert classify_exception(broken) == ("RUNTIME_ERROR", Reason.CUDA_ERROR)
    assert classify_exception(asserted) == ("RUNTIME_ERROR", Reason.DEVICE_ASSERT)
    assert classify_exception(illegal) == ("RUNTIME_ERROR", Reason.ILLEGAL_MEMORY_ACCESS)
