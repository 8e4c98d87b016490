"""The GPU timer's queue-ahead plan (delay sizing, chunking) and its mode choice, on a CPU.
The launches themselves run in benchmarks/timing_fidelity.py on a GPU."""

from __future__ import annotations

from fibray.timing import ahead
from fibray.timing.ahead import (CHUNK_CALLS, DELAY_CAP_US, DELAY_PAD_US, FIRST_CHUNK_CALLS, GIVE_UP_AFTER,
                                 HOST_MARGIN, QueuePlan, calls_per_chunk, choose_mode, sleep_us)


def _chunks(plan: QueuePlan, host_us: float, ahead_: bool = True) -> list[tuple[int, float]]:
    out = []
    while (step := plan.next_chunk()) is not None:
        out.append(step)
        plan.observe(step[0], step[0] * host_us / 1e6, ahead_)
    return out


def test_a_delay_covers_the_hosts_launch_of_its_chunk_with_margin():
    assert sleep_us(40.0, 32) == HOST_MARGIN * 40.0 * 32 + DELAY_PAD_US
    assert sleep_us(40.0, 32) > 40.0 * 32


def test_a_delay_never_passes_the_cap():
    assert sleep_us(1e6, 32) == DELAY_CAP_US


def test_chunks_cover_every_call_once_and_hold_at_most_chunk_calls():
    chunks = _chunks(QueuePlan(203, 40.0), 40.0)
    assert sum(c for c, _ in chunks) == 203
    assert chunks[0][0] == FIRST_CHUNK_CALLS and max(c for c, _ in chunks) == CHUNK_CALLS


def test_slow_launches_make_chunks_short_enough_for_the_cap():
    chunks = _chunks(QueuePlan(50, 2000.0), 2000.0)
    assert calls_per_chunk(2000.0) == int((DELAY_CAP_US - DELAY_PAD_US) / (HOST_MARGIN * 2000.0))
    assert all(c <= calls_per_chunk(2000.0) and d <= DELAY_CAP_US for c, d in chunks)
    assert all(d >= c * 2000.0 for c, d in chunks)  # each still covers its chunk's launch


def test_the_measured_launch_cost_sizes_the_next_delay():
    plan = QueuePlan(100, 10.0)
    calls, _ = plan.next_chunk()
    plan.observe(calls, calls * 80e-6, ahead=True)  # launches were 8x slower than the warm-up said
    assert plan.next_chunk()[1] == sleep_us(80.0, CHUNK_CALLS)


def test_a_chunk_the_gpu_caught_up_with_doubles_the_next_delay():
    plan = QueuePlan(100, 40.0)
    calls, _ = plan.next_chunk()
    plan.observe(calls, calls * 40e-6, ahead=False)
    assert plan.next_chunk()[1] == sleep_us(80.0, CHUNK_CALLS) and plan.queued == 0


def test_calls_that_wait_for_the_gpu_themselves_stop_the_delays():
    chunks = _chunks(QueuePlan(100, 40.0), 40.0, ahead_=False)
    assert all(d > 0 for _, d in chunks[:GIVE_UP_AFTER]) and all(d == 0 for _, d in chunks[GIVE_UP_AFTER:])
    assert sum(c for c, _ in chunks) == 100


def test_verified_chunks_count_as_queued():
    plan = QueuePlan(40, 40.0)
    _chunks(plan, 40.0)
    assert plan.queued == 40


def test_stop_ends_the_plan():
    plan = QueuePlan(100, 40.0)
    plan.next_chunk()
    plan.stop()
    assert plan.next_chunk() is None


def test_the_mode_is_a_function_of_the_two_medians():
    assert choose_mode(0.020, 0.020) == "stream_events"
    assert choose_mode(0.020, 0.031) == "device_sync"  # > 1.25 x 0.020 + 0.005
    assert [choose_mode(0.020, 0.029) for _ in range(3)] == ["stream_events"] * 3


def test_device_sync_is_kept_inside_the_hysteresis_band():
    assert choose_mode(0.020, 0.026, previous="device_sync") == "device_sync"
    assert choose_mode(0.020, 0.026, previous="stream_events") == "stream_events"
    assert choose_mode(0.020, 0.023, previous="device_sync") == "stream_events"  # < 1.10 x 0.020 + 0.002


def test_a_callables_mode_is_remembered_in_the_process():
    def kernel() -> None:
        return None

    assert ahead.previous_mode(kernel) is None
    ahead.remember_mode(kernel, "device_sync")
    assert ahead.previous_mode(kernel) == "device_sync"
    ahead.remember_mode(3, "device_sync")  # not weak-referenceable: no memory, no error
    assert ahead.previous_mode(3) is None
