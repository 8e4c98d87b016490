"""`python -m fibray.sweep` as a user meets it: one-line errors for mistyped keys, `--help` from the same
table README shows, Ctrl-C as one line with exit status 130, nothing left in the temp dir."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fibray.store import TraceStore
from fibray.sweep.config import config_keys
from fibray.sweep.keys import help_text, markdown_table, missing_from_table, table_keys
from _sweep_helpers import REPO, reachable_tmpdir


def _cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = env or {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "fibray.sweep", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("override", ["eval.itertions=5", "+eval.itertions=5", "++eval.itertions=5"])
def test_mistyped_key_is_one_line_naming_the_closest_key(tmp_path, override):
    out = _cli("+experiment=smoke", f"store.root={tmp_path}/store", override, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == "fibray.sweep: error: unknown key eval.itertions (did you mean eval.iterations?)"
    assert not (tmp_path / "store").exists()


def test_mistyped_experiment_names_the_ones_there_are(tmp_path):
    out = _cli("+experiment=smok", cwd=tmp_path)
    assert out.returncode == 2
    have = ", ".join(sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
    assert out.stderr.strip() == ("fibray.sweep: error: experiment=smok: no such experiment "
                                  f"(did you mean experiment=smoke? have: {have})")


def test_help_lists_every_key_with_its_meaning(tmp_path):
    out = _cli("--help", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == help_text()
    for key in config_keys():
        assert re.search(rf"(^|[ ,]){re.escape(key)}([ ,]|$)", out.stdout, re.M), key


def test_key_table_names_every_config_key_once():
    assert missing_from_table() == []
    assert sorted(table_keys()) == sorted(set(table_keys())) == sorted(config_keys())


def test_readme_configuration_table_is_the_key_table():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- config-keys[^>]*-->\n(.*?)\n<!-- /config-keys -->", readme, re.S)
    assert block, "README lost its config-keys block"
    assert block.group(1) == markdown_table(), ("README's table drifted: edit KEY_TABLE in fibray/sweep/keys.py and put "
                                                "fibray.sweep.keys.markdown_table() between README's config-keys markers")


class _Sweep:
    """`python -m fibray.sweep` in its own session (as a terminal's foreground job), stderr read as it comes."""

    def __init__(self, tmp: Path, store: Path, *args: str, launcher: tuple[str, ...] = ("-m", "fibray.sweep")) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmp), RAY_TMPDIR="/tmp")  # Ray's sockets: short paths
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, "+experiment=smoke", "dataset.definitions=[rmsnorm_h4096]",
             f"store.root={store}", "sweep.flush_rows=2", *args],
            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def wait_for(self, predicate, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not predicate() and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.2)
        assert self.proc.poll() is None, "the sweep ended before it could be interrupted:\n" + "".join(self.lines)

    def ctrl_c(self) -> str:
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground process group
        self.proc.wait(timeout=120)
        self._reader.join(timeout=30)
        return "".join(self.lines)


_INTERRUPTED = re.compile(r"^fibray\.sweep: interrupted; (\d+) new result\(s\) saved \((\d+) of 21 in sweep 'smoke'\) "
                          r"in (\S+); rerun the same command to resume$")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["during_ray_start", "after_some_results"])
def test_ctrl_c_is_one_line_saying_what_was_saved_and_exit_130(when):
    tmp = reachable_tmpdir("fibray-test-sigint-")
    store = tmp / "store"
    sweep = _Sweep(tmp, store)
    if when == "during_ray_start":
        sweep.wait_for(lambda: any("starting a local Ray" in ln for ln in sweep.lines))
        time.sleep(0.5)
    else:
        sweep.wait_for(lambda: len(TraceStore(store).files()) >= 1)
    err = sweep.ctrl_c()
    assert sweep.proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    m = _INTERRUPTED.match(last)
    assert m, err[-3000:]
    rows = len(TraceStore(store).read(columns=["job_id"]))
    assert int(m.group(1)) == int(m.group(2)) == rows and Path(m.group(3)) == store.resolve()
    assert (rows == 0) if when == "during_ray_start" else (rows >= 1), rows
    assert not [p for p in tmp.iterdir() if p.name.startswith("fibray-")], "the sweep's temp dirs outlived it"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="uids of their own need root")
def test_a_uid_range_too_narrow_is_one_line_naming_the_key():
    tmp = reachable_tmpdir("fibray-test-uids-")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(TMPDIR=str(tmp), RAY_TMPDIR="/tmp")
    out = _cli("+experiment=smoke", "dataset.definitions=[rmsnorm_h4096]", f"store.root={tmp}/store",
               "runner.uid_range=[200990,200990]", cwd=tmp, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "fibray.sweep: error: no worker slot could be started: NoUidAvailable: runner.uid_range: all 1 uids of "
        "[200990, 200990] are in use on this host; widen the range"), out.stderr[-3000:]


# The Ctrl-C lands while Ray forks its processes: Python runs the fork hooks (logging's among them) and
# swallows what they raise, so the KeyboardInterrupt itself never reaches the sweep (CI saw exit 0).
_SWALLOWED = """
import os, signal, sys
fired = []
def hook():
    if "ray" in sys.modules and not fired:  # the sweep has begun starting Ray
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(100000))  # the handler runs here, inside the hook
os.register_at_fork(after_in_parent=hook)
sys.argv[0] = "fibray.sweep"
from fibray.sweep.__main__ import entry
entry()
"""


@pytest.mark.slow
def test_ctrl_c_swallowed_inside_a_fork_hook_still_stops_the_sweep():
    tmp = reachable_tmpdir("fibray-test-sigint-")
    store = tmp / "store"
    sweep = _Sweep(tmp, store, launcher=("-c", _SWALLOWED))
    sweep.proc.wait(timeout=240)
    sweep._reader.join(timeout=30)
    err = "".join(sweep.lines)
    assert sweep.proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    m = _INTERRUPTED.match(err.strip().splitlines()[-1])
    assert m and int(m.group(1)) == 0 == len(TraceStore(store).read(columns=["job_id"])), err[-3000:]
    assert not [p for p in tmp.iterdir() if p.name.startswith("fibray-")], "the sweep's temp dirs outlived it"
