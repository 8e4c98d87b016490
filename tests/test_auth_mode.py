"""Ray's auth mode in a process that joins a service and later starts a local Ray of its own (a
test session; a notebook): Ray caches RAY_AUTH_MODE, and a local start sets it to token, so a
join that changed the variable alone left the next local head checking a token its driver would
not send ("Failed to start GCS ... InvalidAuthToken")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from _sweep_helpers import REPO

_SCRIPT = textwrap.dedent("""
    import os, ray
    from fibray.sweep.service import auth_kept, use_auth

    def local():
        ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
        ray.shutdown()

    local()                       # Ray's default for a local start: token (it sets the variable)
    before = os.environ.get("RAY_AUTH_MODE")
    with auth_kept():
        use_auth("disabled")      # what joining a service whose head checks no token does
        local()                   # a cluster of that mode, reached with that mode
    assert os.environ.get("RAY_AUTH_MODE") == before, (before, os.environ.get("RAY_AUTH_MODE"))
    local()                       # and the process's own mode is back, config included
    print("OK", before)
""")


@pytest.mark.slow
def test_a_process_that_joined_with_another_auth_mode_starts_its_own_ray_again(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)  # a token file of its own, not the user's
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK token" in out.stdout, out.stderr[-3000:]
