"""The shared-memory poison gate: a kernel's outputs must not depend on shared memory it did not write.

`python -m fibray.promote.smem_poison JOB.json` (sandboxed, one process per workload) fills every
SM's shared memory with a 32-bit pattern by a PTX kernel of its own before each of three calls
(PATTERNS: A, A, B) and saves the outputs; the supervisor compares them bit for bit. A == A != B:
the candidate read shared memory it did not write (initcheck sees global memory only). A != A: not
deterministic, so the gate cannot tell: not_run, never a pass; so too without a GPU or a sandbox.
It sees only reads that reach the outputs (a value read and then masked away changes nothing).
Like the sanitizer gates it finds bugs, not lies: the fill, the probe and the calls run in the
candidate's process, so a candidate that recognises the gate can behave while it runs; the
comparison is the supervisor's.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from fibray.promote.sanitize_runner import RUNNER_UNAVAILABLE, RunnerUnavailable, SanitizeJob, main, prepare
from fibray.promote.sanitizer import DEADLINE_S, GateResult, ToolRun, run_many, sandbox_problem
from fibray.store.promotions import Gate, Outcome
from fibray.workers.process.sandbox import SandboxPolicy

if TYPE_CHECKING:
    import torch

PATTERNS = (0x5A5A5A5A, 0x5A5A5A5A, 0xA5A5A5A5)
"""The fill before each call. Every bit differs between A and B, and neither is a NaN or an Inf read as
fp32, fp16, bf16 or either fp8 (a GPU writes one canonical NaN, which would hide the difference): as
fp32 A is +1.5e16 and B -2.9e-16, as bf16 +1.5e16 and -2.9e-16, as fp16 +203 and -0.022, so sums,
products, min and max of either differ."""
RUNNER = "fibray.promote.smem_poison"
"""`python -m RUNNER JOB.json` is the runner side: run_poisoned in a sandboxed process of its own."""
OUTPUT_FILE = "outputs_{}.safetensors"
"""The outputs of call i (0, 1, 2) in the run's work dir."""
MAX_OUTPUT_BYTES = 2 << 30
"""Output files larger than this are not read back (the gate is not_run)."""
PTX_VERSIONS = {(7, 0): "6.0", (7, 2): "6.1", (7, 5): "6.3", (8, 0): "7.0", (8, 6): "7.1", (8, 7): "7.4",
                (8, 8): "9.0", (8, 9): "7.8", (9, 0): "7.8", (10, 0): "8.6", (10, 1): "8.6", (10, 3): "8.8",
                (11, 0): "9.0", (12, 0): "8.7", (12, 1): "8.8"}
"""Compute capability -> the first PTX ISA version with that .target (the oldest a driver must JIT)."""
_KERNEL = "fibray_smem_poison"
_PROBE = "fibray_smem_probe"
_PROBE_WORDS = 1024
"""Shared-memory words each block of the probe reads back (one block per SM)."""
_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_BLOCKS_PER_SM = 4


class PoisonError(RunnerUnavailable):
    """The poison cannot be applied here (no PTX version for the device, a driver call failed)."""


class Verdict(StrEnum):
    """What the three calls of one workload showed."""

    SAME = "same"
    """The three outputs are bit-identical."""
    CHANGES = "changes"
    """Same with the same pattern, different with the other: it reads shared memory it did not write."""
    NOT_DETERMINISTIC = "not_deterministic"
    """Different with the same pattern: a read of uninitialised shared memory cannot be told apart."""
    RUNNER_FAILED = "runner_failed"
    """The candidate (or its build) raised."""
    TIMEOUT = "timeout"
    """No answer within the deadline; its process group was killed."""
    ERROR = "error"
    """The runner exited with another status (a crash, a signal)."""
    NO_OUTPUTS = "no_outputs"
    """An output file is missing or unreadable."""
    NOT_COMPARED = "not_compared"
    """The poison could not be applied, or the outputs are too large to read back."""


_OUTCOME = {Verdict.SAME: Outcome.PASSED, Verdict.NOT_DETERMINISTIC: Outcome.NOT_RUN,
            Verdict.NOT_COMPARED: Outcome.NOT_RUN}
"""Verdict -> the gate's outcome (the others fail it)."""


def poison_ptx(major: int, minor: int) -> str:
    """The fill kernel for compute capability major.minor: each block writes `pattern` to each of the
    `words` 32-bit words of its dynamic shared memory, its threads striding over them; and the probe,
    whose blocks copy the first `words` words of their shared memory, unwritten, to out[block][word]."""
    version = PTX_VERSIONS.get((major, minor))
    if version is None:
        raise PoisonError(f"no PTX ISA version known for sm_{major}{minor} (PTX_VERSIONS has "
                          f"{', '.join(f'sm_{a}{b}' for a, b in PTX_VERSIONS)})")
    return f"""\
.version {version}
.target sm_{major}{minor}
.address_size 64

.extern .shared .align 16 .b8 fibray_poison_smem[];

.visible .entry {_KERNEL}(
    .param .u32 words,
    .param .u32 pattern
)
{{
    .reg .pred %p;
    .reg .b32 %r<8>;

    ld.param.u32 %r1, [words];
    ld.param.u32 %r2, [pattern];
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, fibray_poison_smem;
    setp.ge.u32 %p, %r3, %r1;
    @%p bra DONE;
LOOP:
    shl.b32 %r6, %r3, 2;
    add.u32 %r7, %r5, %r6;
    st.volatile.shared.u32 [%r7], %r2;
    add.u32 %r3, %r3, %r4;
    setp.lt.u32 %p, %r3, %r1;
    @%p bra LOOP;
DONE:
    ret;
}}

.visible .entry {_PROBE}(
    .param .u64 out,
    .param .u32 words
)
{{
    .reg .pred %p;
    .reg .b32 %r<10>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [words];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r8, %ctaid.x;
    mul.lo.u32 %r9, %r8, %r1;
    mov.u32 %r5, fibray_poison_smem;
    setp.ge.u32 %p, %r3, %r1;
    @%p bra PROBE_DONE;
PROBE_LOOP:
    shl.b32 %r6, %r3, 2;
    add.u32 %r7, %r5, %r6;
    ld.volatile.shared.u32 %r2, [%r7];
    add.u32 %r6, %r9, %r3;
    mul.wide.u32 %rd3, %r6, 4;
    add.u64 %rd4, %rd2, %rd3;
    st.global.u32 [%rd4], %r2;
    add.u32 %r3, %r3, %r4;
    setp.lt.u32 %p, %r3, %r1;
    @%p bra PROBE_LOOP;
PROBE_DONE:
    ret;
}}
"""


def _driver() -> ctypes.CDLL:
    """libcuda with the signatures of the calls made here."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PoisonError(f"cannot load libcuda.so.1: {e}") from None
    ptr, i32, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
    sigs = {
        "cuCtxGetCurrent": [ctypes.POINTER(ptr)],
        "cuCtxGetDevice": [ctypes.POINTER(i32)],
        "cuDeviceGetAttribute": [ctypes.POINTER(i32), i32, i32],
        "cuModuleLoadData": [ctypes.POINTER(ptr), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(ptr), ptr, ctypes.c_char_p],
        "cuFuncSetAttribute": [ptr, i32, i32],
        "cuLaunchKernel": [ptr, u32, u32, u32, u32, u32, u32, u32, ptr, ctypes.POINTER(ptr), ctypes.POINTER(ptr)],
        "cuCtxSynchronize": [],
        "cuGetErrorName": [i32, ctypes.POINTER(ctypes.c_char_p)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


class SharedMemoryPoison:
    """The fill kernel loaded into the current CUDA context (torch's primary context: make it current
    with any torch CUDA operation first), sized to fill every SM's shared memory."""

    def __init__(self) -> None:
        self._cu = _driver()
        ctx = ctypes.c_void_p()
        self._check(self._cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise PoisonError("cuCtxGetCurrent: no current CUDA context (run a torch CUDA operation first)")
        dev = ctypes.c_int()
        self._check(self._cu.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        major, minor, sms, threads, smem = (self._attribute(a, dev) for a in (
            _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, _CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
        self.ptx = poison_ptx(major, minor)
        self._module, self._fn, self._probe = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._cu.cuModuleLoadData(ctypes.byref(self._module), self.ptx.encode()),
                    f"cuModuleLoadData (PTX for sm_{major}{minor})")
        for fn, name in ((self._fn, _KERNEL), (self._probe, _PROBE)):
            self._check(self._cu.cuModuleGetFunction(ctypes.byref(fn), self._module, name.encode()),
                        f"cuModuleGetFunction({name})")
        self._check(self._cu.cuFuncSetAttribute(self._fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                    f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem})")
        self.shared_bytes = smem
        """Dynamic shared memory per block: the device's opt-in maximum, so one block fills an SM."""
        self.grid = sms * _BLOCKS_PER_SM
        """Blocks per fill: several per SM, so that every SM runs at least one."""
        self.threads = min(1024, threads)
        self.sms = sms

    def _attribute(self, attribute: int, dev: ctypes.c_int) -> int:
        value = ctypes.c_int()
        self._check(self._cu.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev.value),
                    f"cuDeviceGetAttribute({attribute})")
        return value.value

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._cu.cuGetErrorName(rc, ctypes.byref(name))
            raise PoisonError(f"{what} failed: CUDA error {rc} ({(name.value or b'?').decode()})")

    def _launch(self, fn: ctypes.c_void_p, name: str, grid: int, threads: int, shared: int, stream: int,
                *args: ctypes.c_uint32 | ctypes.c_uint64) -> None:
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        self._check(self._cu.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, shared, stream or None, params, None),
                    f"cuLaunchKernel({name}, {grid} blocks x {threads} threads, {shared} B shared)")
        self._check(self._cu.cuCtxSynchronize(), f"cuCtxSynchronize after {name}")

    def fill(self, pattern: int, stream: int) -> None:
        """Fill every SM's shared memory with `pattern` on `stream`, and wait until it is done (the
        candidate may launch on any stream)."""
        self._launch(self._fn, _KERNEL, self.grid, self.threads, self.shared_bytes, stream,
                     ctypes.c_uint32(self.shared_bytes // 4), ctypes.c_uint32(pattern))

    def reaches(self, pattern: int, stream: int) -> float:
        """The fraction of a later kernel's unwritten shared-memory words (one small block per SM) that
        hold `pattern` after fill(pattern): 0 means the poison does not survive to the next kernel here."""
        import torch

        out = torch.zeros(self.sms * _PROBE_WORDS, dtype=torch.int32, device="cuda")
        self.fill(pattern, stream)
        self._launch(self._probe, _PROBE, self.sms, 256, _PROBE_WORDS * 4, stream,
                     ctypes.c_uint64(out.data_ptr()), ctypes.c_uint32(_PROBE_WORDS))
        want = pattern - (1 << 32) if pattern >= 1 << 31 else pattern
        return float((out == want).float().mean())

    def self_check(self, stream: int) -> str:
        """Raise PoisonError unless both patterns reach a later kernel; else a line saying how far they do."""
        a, b = (self.reaches(p, stream) for p in (PATTERNS[0], PATTERNS[2]))
        line = (f"smem_poison probe: a later kernel read {a:.1%} ({PATTERNS[0]:#010x}) and {b:.1%} "
                f"({PATTERNS[2]:#010x}) of {self.sms} x {_PROBE_WORDS} unwritten shared-memory words; "
                f"fill {self.grid} blocks x {self.threads} threads x {self.shared_bytes} B")
        if min(a, b) == 0:
            raise PoisonError(f"the poison does not reach a later kernel's shared memory on this device ({line})")
        return line


def run_poisoned(job: SanitizeJob, workdir: Path) -> None:
    """Runner side: build the candidate as sanitize_runner.run does, make its inputs once, then per
    pattern copy them fresh, zero fresh outputs (destination-passing) or take the returned ones, fill
    shared memory, call, synchronise and save the outputs' CPU copies to OUTPUT_FILE. On the CPU (tests
    of this plumbing only) there is no shared memory to fill, and nothing is poisoned."""
    import torch
    from safetensors.torch import save_file

    from fibray.evaluate.candidate import normalize_outputs
    from fibray.evaluate.inputs import allocate_outputs

    device, runnable, cpu_args = prepare(job, workdir)
    poison: Optional[SharedMemoryPoison] = None
    for i, pattern in enumerate(PATTERNS):
        args = [a.to(device, copy=True) if isinstance(a, torch.Tensor) else a for a in cpu_args]
        outs = ([o.zero_() for o in allocate_outputs(job.definition, job.workload.axes, device)]
                if runnable.destination_passing_style else [])
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device).cuda_stream
            if poison is None:  # after the copies: torch's context is current
                poison = SharedMemoryPoison()
                print(poison.self_check(stream), flush=True)
            poison.fill(pattern, stream)
        if runnable.destination_passing_style:
            runnable.fn(*args, *outs)
        else:
            outs = normalize_outputs(runnable.fn(*args), job.definition)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        save_file(_cpu_copies(job, outs), str(workdir / OUTPUT_FILE.format(i)))


def _cpu_copies(job: SanitizeJob, outs: list[Any]) -> dict[str, torch.Tensor]:
    import torch

    copies = {}
    for name, o in zip(job.definition.outputs, outs):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"output {name!r} is a {type(o).__name__}, not a tensor")
        copies[name] = o.detach().to("cpu", copy=True).contiguous()
    return copies


@dataclass
class Check:
    """The verdict of one workload."""

    verdict: Verdict
    detail: str
    """What differs, or why there is no comparison."""
    differing: int | None = None
    """Elements that differ between the calls compared (None where not compared)."""


def _read(path: Path) -> bytes:
    """A regular file the sandboxed run wrote, never through a link (the reader may be root)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if info.st_size > MAX_OUTPUT_BYTES:
            raise _TooLarge(f"{path.name} has {info.st_size} bytes, over {MAX_OUTPUT_BYTES}")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


class _TooLarge(OSError):
    pass


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, int]:
    """Output name -> elements whose bits differ (all of them where the names, dtypes or shapes differ)."""
    out = {}
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape:
            out[name] = max(t.numel() for t in (x, y) if t is not None)
        elif x.numel() and (n := int((_bytes(x) != _bytes(y)).any(dim=1).sum())):
            out[name] = n
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One row of raw bytes per element: bits, not values, so NaN payloads and -0.0 compare exactly."""
    import torch

    flat = t.reshape(-1)
    return flat.view(torch.uint8).view(flat.numel(), flat.element_size())


def _describe(diff: dict[str, int], outputs: dict[str, torch.Tensor]) -> str:
    return "; ".join(f"{n}: {k} of {outputs[n].numel() if n in outputs else '?'} elements differ"
                     for n, k in diff.items())


def compare_outputs(workdir: Path) -> Check:
    """Compare the three calls' output files in a run's work dir bit for bit."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    runs = []
    for i in range(len(PATTERNS)):
        path = workdir / OUTPUT_FILE.format(i)
        try:
            runs.append(load(_read(path)))
        except _TooLarge as e:
            return Check(Verdict.NOT_COMPARED, f"outputs not read back: {e}")
        except FileNotFoundError:
            return Check(Verdict.NO_OUTPUTS, f"{path.name} is missing (the runner saved {i} of {len(PATTERNS)})")
        except (OSError, SafetensorError, ValueError) as e:
            return Check(Verdict.NO_OUTPUTS, f"{path.name} is unreadable: {type(e).__name__}: {e}")
    first, again, other = runs
    if diff := _differing(first, again):
        return Check(Verdict.NOT_DETERMINISTIC, f"the same pattern twice: {_describe(diff, first)}", sum(diff.values()))
    if diff := _differing(first, other):
        return Check(Verdict.CHANGES, f"pattern {PATTERNS[0]:#010x} vs {PATTERNS[2]:#010x}: {_describe(diff, first)}",
                     sum(diff.values()))
    return Check(Verdict.SAME, f"{sum(t.numel() for t in first.values())} elements bit-identical over the 3 calls", 0)


def check_of(run: ToolRun, deadline_s: float) -> Check:
    """One workload's verdict from its run: the comparison when the runner finished, else why not."""
    if run.outcome == "clean":
        return run.found if isinstance(run.found, Check) else Check(Verdict.NO_OUTPUTS, "the outputs were not read back")
    if run.outcome == "timeout":
        return Check(Verdict.TIMEOUT, f"no answer within {deadline_s:.0f}s")
    if run.outcome == "runner_failed":
        return Check(Verdict.RUNNER_FAILED, _last_line(run.tail))
    if run.outcome == "out_of_memory":
        return Check(Verdict.ERROR, _last_line(run.tail))
    if run.returncode == RUNNER_UNAVAILABLE:
        return Check(Verdict.NOT_COMPARED, "the poison could not be applied: " + _last_line(run.tail))
    return Check(Verdict.ERROR, f"exited with status {run.returncode}: " + _last_line(run.tail))


def _last_line(tail: str) -> str:
    lines = [line.strip() for line in tail.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


_MEANING = {
    Verdict.SAME: "outputs bit-identical",
    Verdict.CHANGES: "outputs change with the shared-memory poison pattern: it reads shared memory it did not write",
    Verdict.NOT_DETERMINISTIC: "not deterministic run to run: a read of uninitialised shared memory cannot be told apart",
    Verdict.RUNNER_FAILED: "the candidate raised",
    Verdict.TIMEOUT: "timed out",
    Verdict.ERROR: "the runner failed",
    Verdict.NO_OUTPUTS: "no outputs to compare",
    Verdict.NOT_COMPARED: "not compared",
}
"""Verdict -> the words of the gate's reason (the check's detail follows)."""


def judge(checks: dict[str, Check]) -> GateResult:
    """The gate's verdict over its workloads (uuid -> check): failed if any failed, else not_run if any
    could not be compared, else passed."""
    evidence = {"patterns": [f"{p:#010x}" for p in PATTERNS], "runs": [
        {"workload": w, "verdict": c.verdict.value, "differing": c.differing, "detail": c.detail}
        for w, c in checks.items()]}
    if not checks:
        return GateResult(Gate.SMEM_POISON, Outcome.NOT_RUN, "not_run: no workloads to run it on", evidence)
    by_outcome: dict[Outcome, list[tuple[str, Check]]] = {}
    for w, c in checks.items():
        by_outcome.setdefault(_OUTCOME.get(c.verdict, Outcome.FAILED), []).append((w, c))
    for outcome in (Outcome.FAILED, Outcome.NOT_RUN):
        if outcome in by_outcome:
            w, c = by_outcome[outcome][0]
            why = _MEANING[c.verdict]
            prefix = "not_run: " if outcome is Outcome.NOT_RUN else ""
            return GateResult(Gate.SMEM_POISON, outcome, f"{prefix}{len(by_outcome[outcome])}/{len(checks)} workload(s) "
                              f"{outcome.value}; {w}: {why} ({c.detail})", evidence)
    return GateResult(Gate.SMEM_POISON, Outcome.PASSED,
                      f"outputs bit-identical under both poison patterns on {len(checks)} workload(s)", evidence)


def unavailable(jobs: list[SanitizeJob], policy: SandboxPolicy) -> str | None:
    """Why the gate cannot run here (no GPU, a job not on the GPU, no sandbox), else None."""
    from fibray.workers.start import visible_gpu_count

    if visible_gpu_count() == 0:
        return "no GPU visible to this process (NVML counts none)"
    if cpu := [j.workload.uuid for j in jobs if j.device != "cuda"]:
        return f"jobs not on the GPU ({', '.join(cpu[:3])}): no shared memory to poison there"
    return sandbox_problem(policy)


def smem_poison_gate(jobs: list[SanitizeJob], *, deadline_s: float = DEADLINE_S, parallel: int = 2,
                     policy: SandboxPolicy | None = None, why_not: str | None = None) -> GateResult:
    """The shared-memory poison gate of one candidate over its workloads (jobs: one per workload), each
    workload one sandboxed runner process with its own deadline; why_not: a reason it is not_run."""
    policy = policy or SandboxPolicy()
    why_not = why_not or unavailable(jobs, policy)
    if why_not is not None:
        return GateResult(Gate.SMEM_POISON, Outcome.NOT_RUN, f"not_run: {why_not}", {"reason": why_not})
    if not jobs:
        return judge({})
    runs = run_many([([], Gate.SMEM_POISON.value, job) for job in jobs], deadline_s=deadline_s, parallel=parallel,
                    policy=policy, module=RUNNER, inspect=compare_outputs)
    result = judge({r.workload: check_of(r, deadline_s) for r in runs})
    for entry, r in zip(result.evidence["runs"], runs):
        probe = [line for line in r.tail.splitlines() if line.startswith("smem_poison probe:")]
        entry.update(returncode=r.returncode, wall_s=r.wall_s, probe=probe[0] if probe else None,
                     report=r.tail[-2000:] if r.outcome != "clean" else r.tail[-400:])
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], run_poisoned, RUNNER))
