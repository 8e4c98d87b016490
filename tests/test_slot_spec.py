"""The pool -> slot seam: RunnerConfig -> PoolOptions -> SlotSpec, one typed value per slot actor."""

from __future__ import annotations

import pickle

import pytest

from fibray.sweep.config import RunnerConfig
from fibray.sweep.pool import PoolOptions, Slot
from fibray.workers.spec import GPU_AUTO_LANES, SandboxPolicy, SlotSpec, slot_lanes


def test_runner_config_reaches_the_slot_spec_as_a_typed_sandbox_policy() -> None:
    r = RunnerConfig(lanes=3, standby=False, spare_isolated=2, workdir="/tmp/w", isolate_network=False,
                     drop_privileges=False, memory_limit_gb=2, max_open_files=128, max_processes=64)
    spec = PoolOptions.from_runner(r, num_slots=2, torch_threads=4, build_cache="/tmp/c").slot_spec("gpu1.2")
    assert spec == SlotSpec(
        name="gpu1.2", workdir="/tmp/w", torch_threads=4, standby=False, spare_isolated=2, lanes=3,
        sandbox=SandboxPolicy(isolate_network=False, drop_privileges=False, memory_limit_bytes=2 << 30,
                              max_open_files=128, max_processes=64, build_cache="/tmp/c"))
    assert pickle.loads(pickle.dumps(spec)) == spec  # it crosses to the actor by value


@pytest.mark.parametrize(("standby", "lanes", "cpus", "standbys"), [
    ("auto", 1, 2, 1), ("auto", 4, 2, 4), ("auto", 1, 16, 8), ("auto", 2, 64, 8), ("auto", 1, 6, 3),
    (True, 4, 16, 1), (False, 4, 16, 0), (3, 1, 16, 3), (0, 2, 16, 0)])
def test_runner_standby_gives_each_slot_its_count_of_warm_standbys(standby, lanes, cpus, standbys) -> None:
    """auto: one per lane (each change of solution retires a lane's executor; a lane should not
    wait for another's successor) and up to one per two CPUs per GPU, at most 8; true keeps its
    old meaning, one."""
    spec = PoolOptions.from_runner(RunnerConfig(standby=standby, lanes=lanes), num_slots=1,
                                   torch_threads=cpus).slot_spec("gpu0.1")
    assert spec.standby == standbys and type(spec.standby) is int


def test_a_negative_standby_count_is_refused() -> None:
    with pytest.raises(ValueError, match="standby"):
        RunnerConfig(standby=-1)
    with pytest.raises(ValueError, match="SlotSpec.standby: must be at least 0, got -1"):
        SlotSpec("gpu0.1", standby=-1)


def test_persistent_isolation_asks_slots_for_no_spare_executors() -> None:
    opts = PoolOptions.from_runner(RunnerConfig(isolation="persistent", spare_isolated=2), num_slots=1)
    assert opts.slot_spec("gpu0.1").spare_isolated == 0


def test_no_memory_limit_in_the_runner_means_none_in_the_sandbox() -> None:
    opts = PoolOptions.from_runner(RunnerConfig(memory_limit_gb=None), num_slots=1)
    assert opts.slot_spec("gpu0.1").sandbox.memory_limit_bytes is None


def test_a_slot_spec_with_no_lanes_is_refused() -> None:
    with pytest.raises(ValueError, match="SlotSpec.lanes: must be at least 1, got 0"):
        SlotSpec("gpu0.1", lanes=0)


@pytest.mark.parametrize(("cpus_per_gpu", "lanes"), [(1, 1), (2, 1), (3, 1), (4, 2), (7, 3), (8, 4), (16, 4), (128, 4)])
def test_auto_lanes_are_half_the_hosts_cpus_per_gpu_from_1_to_4(cpus_per_gpu: int, lanes: int) -> None:
    opts = PoolOptions.from_runner(RunnerConfig(), num_slots=1, torch_threads=cpus_per_gpu)  # lanes: auto by default
    assert opts.slot_spec("gpu0.1").lanes == lanes


def test_a_number_of_lanes_is_taken_as_given_whatever_the_host() -> None:
    spec = PoolOptions.from_runner(RunnerConfig(lanes=6), num_slots=1, torch_threads=2).slot_spec("gpu0.1")
    assert spec.lanes == 6 and not spec.lanes_auto
    assert slot_lanes(spec, "cuda") == 6 and slot_lanes(spec, "cpu") == 6


def test_auto_lanes_are_the_cpu_figure_on_a_cpu_slot_and_one_on_a_gpu() -> None:
    """Every timed window on a GPU stops the other lanes' executors: auto gives a GPU slot GPU_AUTO_LANES."""
    spec = PoolOptions.from_runner(RunnerConfig(), num_slots=1, torch_threads=16).slot_spec("gpu0.1")
    assert spec.lanes == 4 and spec.lanes_auto
    assert slot_lanes(spec, "cpu") == 4
    assert slot_lanes(spec, "cuda") == GPU_AUTO_LANES == 1


def test_the_pool_sends_a_slot_as_many_jobs_as_the_lanes_it_runs() -> None:
    """Until a slot says how many lanes it runs, the configured figure; then the slot's own."""
    slot = Slot(index=0)
    assert slot.lanes(4) == 4
    slot.info = {"name": "gpu0.1", "lanes": 1}
    assert slot.lanes(4) == 1


def test_lanes_other_than_auto_or_1_to_16_are_refused() -> None:
    from pydantic import ValidationError

    for bad in (0, 17, "many"):
        with pytest.raises(ValidationError):
            RunnerConfig(lanes=bad)
