"""`python -m fibray.sweep` as a user meets it: one-line errors for mistyped keys, `--help` from the same
table README shows, Ctrl-C as one line with exit status 130, nothing left in the temp dir."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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
    assert block.group(1) == markdown_table(), "README's table drifted from fibray/sweep/keys.py"
