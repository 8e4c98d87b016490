"""The GPU timer's queue-ahead plan (delay sizing, chunking) and its mode choice, on a CPU.
The launches themselves run in benchmarks/timing_fidelity.py on a GPU."""

from __future__ import annotations

from fibray.timing import ahead
from fibray.timing.ahead import (BACKLOG_TRUST, CHUNK_CALLS, DELAY_CAP_US, DELAY_PAD_US, FIRST_CHUNK_CALLS,
                                 GIVE_UP_AFTER, HOST_MARGIN, Backlog, QueuePlan, calls_per_chunk, choose_mode,
                                 sleep_us)


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


def test_a_chunks_delay_only_makes_up_what_the_gpus_backlog_does_not_cover():
    plan = QueuePlan(100, 40.0)
    assert plan.next_chunk(backlog_us=100.0)[1] == sleep_us(40.0, FIRST_CHUNK_CALLS) - 100.0
    assert plan.next_chunk(backlog_us=1e9)[1] == 0.0  # the GPU is busy for longer than the launch takes
    assert plan.next_chunk(backlog_us=-5.0)[1] == sleep_us(40.0, CHUNK_CALLS)  # nothing known ahead


def test_the_backlog_counts_delays_and_learned_calls_after_what_was_queued_before():
    b = Backlog()
    assert b.us(0) == 0.0
    b.queued(launched_ns=0, end_ns=1_000_000, delay_us=2000.0, calls=8, ahead=True)
    assert b.free_at == 2_000_000 and b.us(1_000_000) == 1000.0  # half the delay still to spin
    b.learn(span_ms=0.8, calls=8)  # 100 us a call on the GPU
    assert abs(b.per_call_us - BACKLOG_TRUST * 100.0) < 1e-9
    b.queued(launched_ns=1_500_000, end_ns=3_000_000, delay_us=500.0, calls=32, ahead=True)
    expected = 2_000_000 + (500.0 + 32 * BACKLOG_TRUST * 100.0) * 1e3  # behind the first chunk
    assert abs(b.free_at - expected) <= 1
    b.idle(now_ns=3_100_000)
    assert b.us(3_100_000) == 0.0


def test_a_chunk_the_gpu_caught_up_with_leaves_nothing_ahead_and_teaches_nothing():
    b = Backlog()
    b.queued(launched_ns=0, end_ns=10_000, delay_us=500.0, calls=8, ahead=True)
    b.learn(span_ms=3.2, calls=32)
    assert b.per_call_us > 0
    b.queued(launched_ns=20_000, end_ns=30_000, delay_us=5000.0, calls=32, ahead=False)
    assert b.us(30_000) == 0.0 and b.per_call_us == 0.0  # the GPU may be idle now: the next delay is whole
    b.queued(launched_ns=40_000, end_ns=50_000, delay_us=2000.0, calls=32, ahead=True)
    b.learn(span_ms=9.6, calls=32)  # the chunk the GPU caught up with ran at the host's pace: not learned
    assert b.per_call_us == 0.0
    assert b.us(40_000) == 2000.0  # its delay is counted again: the estimate builds up
    b.queued(launched_ns=60_000, end_ns=70_000, delay_us=100.0, calls=32, ahead=True)
    b.learn(span_ms=3.2, calls=32)  # the chunk before was queued ahead: learned
    assert abs(b.per_call_us - BACKLOG_TRUST * 100.0) < 1e-9