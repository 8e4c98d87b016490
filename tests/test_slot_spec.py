"""The pool -> slot seam: RunnerConfig -> PoolOptions -> SlotSpec, one typed value per slot actor."""

from __future__ import annotations

import pickle

import pytest

from fibray.sweep.config import RunnerConfig
from fibray.sweep.pool import PoolOptions
from fibray.workers.spec import SandboxPolicy, SlotSpec


def test_runner_config_reaches_the_slot_spec_as_a_typed_sandbox_policy() -> None:
    r = RunnerConfig(lanes=3, standby=False, spare_isolated=2, workdir="/tmp/w", isolate_network=False,
                     drop_privileges=False, memory_limit_gb=2, max_open_files=128, max_processes=64)
    spec = PoolOptions.from_runner(r, num_slots=2, torch_threads=4, build_cache="/tmp/c").slot_spec("gpu1.2")
    assert spec == SlotSpec(
        name="gpu1.2", workdir="/tmp/w", torch_threads=4, standby=False, spare_isolated=2, lanes=3,
        sandbox=SandboxPolicy(isolate_network=False, drop_privileges=False, memory_limit_bytes=2 << 30,
                              max_open_files=128, max_processes=64, build_cache="/tmp/c"))
    assert pickle.loads(pickle.dumps(spec)) == spec  # it crosses to the actor by value


def test_persistent_isolation_asks_slots_for_no_spare_executors() -> None:
    opts = PoolOptions.from_runner(RunnerConfig(isolation="persistent", spare_isolated=2), num_slots=1)
    assert opts.slot_spec("gpu0.1").spare_isolated == 0


def test_no_memory_limit_in_the_runner_means_none_in_the_sandbox() -> None:
    opts = PoolOptions.from_runner(RunnerConfig(memory_limit_gb=None), num_slots=1)
    assert opts.slot_spec("gpu0.1").sandbox.memory_limit_bytes is None


def test_a_slot_spec_with_no_lanes_is_refused() -> None:
    with pytest.raises(ValueError, match="SlotSpec.lanes: must be at least 1, got 0"):
        SlotSpec("gpu0.1", lanes=0)
