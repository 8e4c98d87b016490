"""Compiling ahead with fibray's privileges lends none of them to the compiler: a solution's `#include`
or `.incbin` of a file only root may read fails in the jail (and, outside it, would leak the file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fibray.compile.cache import ArtifactCache, compile_ahead
from fibray.workers.process.compile_jail import CompileJail
from _sweep_helpers import reachable_tmpdir
from test_build_cache import _KERNEL, _solution

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="a jail hands folders to other uids")]

SECRET = "fibray_secret_7f3a_token"


@pytest.fixture
def secret() -> Path:
    folder = reachable_tmpdir("fibray-secret-")  # others may pass through, as to any folder on the way
    path = folder / "signing.key"
    path.write_text(f"{SECRET} = 1;\n")
    path.chmod(0o600)  # root's alone, as the store's keys are
    return path


def test_an_include_of_a_root_only_file_fails_in_the_jail_and_would_leak_it_outside(secret: Path) -> None:
    thief = _solution("thief", f'#include "{secret}"\n' + _KERNEL)
    jailed = compile_ahead(thief, reachable_tmpdir("fibray-jail-cache-"), 120, jail=CompileJail())
    assert jailed is not None and "Permission denied" in jailed and SECRET not in jailed
    lent = compile_ahead(thief, reachable_tmpdir("fibray-open-cache-"), 120)  # what root's compiler does
    assert lent is not None and SECRET in lent  # the secret, in an error a candidate's author reads


def test_an_incbin_of_a_root_only_file_fails_in_the_jail(secret: Path) -> None:
    thief = _solution("incbin", f'asm(".section .rodata\\n.incbin \\"{secret}\\"\\n.text");\n' + _KERNEL)
    assert compile_ahead(thief, reachable_tmpdir("fibray-open-cache-"), 120) is None  # root embeds the file
    err = compile_ahead(thief, reachable_tmpdir("fibray-jail-cache-"), 120, jail=CompileJail())
    assert err is not None and "signing.key" in err


def test_a_jailed_build_is_fibrays_own_and_writable_by_nobody_else() -> None:
    cache = ArtifactCache(reachable_tmpdir("fibray-jail-cache-"), compile_timeout_s=120, jail=CompileJail())
    result = cache.ensure(_solution("honest"))
    assert result.entry.status == "ok", result.entry.message
    for top, dirs, files in os.walk(result.path):
        for name in [top, *(os.path.join(top, n) for n in [*dirs, *files])]:
            st = os.lstat(name)
            assert st.st_uid == os.geteuid() and not st.st_mode & 0o022, name  # no executor may write it
            assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), name
    assert (result.path / "lib.so").is_file()


def test_the_offender_that_includes_a_root_only_file_builds_it_in_only_without_the_jail() -> None:
    from fibray.schema import Solution

    offender = Solution.model_validate_json((Path(__file__).parent / "candidates" / "includes_root_file.json").read_text())
    folder = Path("/tmp/fibray-compile-secret")  # where tests/candidates/includes_root_file.json looks
    folder.mkdir(mode=0o755, exist_ok=True)
    key = folder / "signing.key"
    key.write_text(f'static const char fibray_signing_key[] = "{SECRET}";\n')
    key.chmod(0o600)
    try:
        jailed = compile_ahead(offender, reachable_tmpdir("fibray-jail-cache-"), 120, jail=CompileJail())
        assert jailed is not None and "Permission denied" in jailed and SECRET not in jailed
        cache = ArtifactCache(reachable_tmpdir("fibray-open-cache-"), compile_timeout_s=120)  # root's own compiler
        built = cache.ensure(offender)
        assert built.entry.status == "ok", built.entry.message
        assert SECRET.encode() in (built.path / "lib.so").read_bytes()  # the secret, in what the candidate runs
    finally:
        key.unlink()
