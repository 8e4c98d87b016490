"""README's examples run as written in a fresh copy of the checkout with nothing beside it: every
`python -m fibray...` command of the fenced blocks marked `tested` (```bash tested), in order."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fibray.store import TraceStore
from _sweep_helpers import REPO, reachable_tmpdir

README = REPO / "README.md"


def readme_commands(text: str) -> list[str]:
    """The fibray commands of README's `tested` blocks: continuations joined, comments dropped,
    `&&` chains split; install and test commands (pip, pytest) are not examples to run here."""
    commands = []
    for block in re.findall(r"^```bash tested\n(.*?)^```$", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            commands += [c.strip() for c in line.split("&&") if c.strip().startswith("python -m fibray")]
    return commands


def _fresh_copy(dest: Path) -> Path:
    """The checkout's files (tracked and new, not ignored), as a clone would have them, and nothing else."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_readme_marks_its_runnable_examples():
    commands = readme_commands(README.read_text())
    assert commands[0] == "python -m fibray.sweep +experiment=smoke"  # README starts with the smoke sweep
    sweeps = [c for c in commands if c.startswith("python -m fibray.sweep")]
    names = [re.search(r"sweep\.name=(\S+)", c).group(1) for c in sweeps[1:]]
    assert len(sweeps) >= 3 and len(set(names)) == len(names)  # each example its own sweep
    assert not any("../" in c or "/shared/" in c for c in commands)  # nothing beside the clone


@pytest.mark.slow
def test_readme_examples_run_in_a_fresh_copy():
    base = reachable_tmpdir("fibray-readme-")
    clone, tmp = base / "fibray", base / "tmp"
    tmp.mkdir(mode=0o755)
    _fresh_copy(clone)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(clone), TMPDIR=str(tmp), RAY_TMPDIR="/tmp")
    outputs = []
    for command in readme_commands(README.read_text()):
        argv = shlex.split(command)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{command}\n{out[-4000:]}"
        assert "Traceback" not in out and "Token authentication" not in out, f"{command}\n{out[-4000:]}"
        outputs.append(out)
    store = TraceStore(clone / "fibray-store")
    rows = store.read(columns=["sweep", "dataset_name", "dataset_hash", "author"]).to_pylist()
    by_sweep = {}
    for r in rows:
        by_sweep.setdefault(r["sweep"], set()).add((r["dataset_name"], r["dataset_hash"]))
    assert {"smoke", "llm-sample", "core-references"} <= set(by_sweep)
    assert all(len(v) == 1 for v in by_sweep.values())  # one dataset per sweep
    assert {r["author"] for r in rows if r["sweep"] == "core-references"} == {"reference"}
    assert (clone / "report" / "report.html").is_file()
    assert not [p for p in tmp.iterdir() if p.name.startswith("fibray-")], "a sweep left its temp dirs"
    shutil.rmtree(base, ignore_errors=True)
