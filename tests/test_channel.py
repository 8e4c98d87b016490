"""The executor channel: tensors through the shared-memory arena (or the socket when they do
not fit) arrive exact, and a forged message is refused without running anything."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from fibray.evaluate.candidate import CandidateFailure, TimeResult, TrialOutput
from fibray.workers.process.channel import (MAX_REPLY_BYTES, Arena, BadMessage, DeadlineExceeded, Health, Op, Reply,
                                            Request, checked, expect, recv, recv_fds, send, send_fds)


@pytest.fixture()
def channel():
    a, b = socket.socketpair()
    ours, theirs = Connection(a.detach()), Connection(b.detach())
    yield ours, theirs
    ours.close()
    theirs.close()


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 20, generator=g).to(torch.bfloat16)
    return [
        big,
        torch.randn(6, 10, generator=g)[:, 1:7:2],          # non-contiguous
        torch.randn(257, generator=g).to(torch.float8_e4m3fn),
        torch.tensor(3.5),                                   # 0-dim
        torch.empty(0, 4),
        torch.rand(33, generator=g) > 0.5,                    # bool
        torch.arange(7, dtype=torch.int64),
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                      b.contiguous().view(-1).view(torch.uint8))


def _exchange(channel, arena_size: int, rounds: int = 3):
    ours, theirs = channel
    mine = Arena.create(arena_size)
    executors = Arena(mine.fd, mine.size)  # the executor's own mapping of the same memory
    sent = _tensors()
    received = []

    def executor():  # as the real one: a reply answers a request (sent once the last reply was copied out)
        for i in range(rounds):
            recv(theirs, None, trusted=True)
            send(theirs, Reply(True, [t + i if t.dtype in (torch.bfloat16, torch.int64) else t for t in sent]), executors)

    t = threading.Thread(target=executor)
    t.start()
    for i in range(rounds):
        send(ours, Request("trial", trial=i))
        received.append(recv(ours, time.monotonic() + 30, mine).value)
    t.join()
    return sent, received, executors


def test_arena_round_trip_is_exact_for_every_kind_of_tensor(channel):
    sent, received, executors = _exchange(channel, 64 << 20)
    assert executors.used > (1 << 21)  # the bf16 megabyte-pair went through shared memory
    for i, outs in enumerate(received):  # each message reuses the arena; earlier ones were copied out
        expect = [t + i if t.dtype in (torch.bfloat16, torch.int64) else t for t in sent]
        assert all(_same(a, b) for a, b in zip(outs, expect))
        assert all(o.data_ptr() < executors.bytes.data_ptr() or o.data_ptr() >= executors.bytes.data_ptr() + executors.size
                   for o in outs if o.numel()), "a received tensor still points into the arena"
    assert _same(received[0][0], sent[0]) and not _same(received[1][0], sent[0])


def test_a_reply_too_big_for_the_arena_goes_over_the_socket(channel):
    sent, received, executors = _exchange(channel, 1 << 20, rounds=1)  # the 2 MB tensor does not fit
    assert all(_same(a, b) for a, b in zip(received[0], sent))


def test_other_reply_types_travel(channel):
    ours, theirs = channel
    failure = CandidateFailure(status="RUNTIME_ERROR", reason="exception", log="log")
    send(theirs, Reply(False, TrialOutput(failure=failure, draws=torch.arange(6).view(2, 3)), error="e"))
    r = recv(ours, time.monotonic() + 5)
    assert expect(r, TrialOutput).failure.reason == "exception" and r.error == "e"
    assert torch.equal(r.value.draws, torch.arange(6).view(2, 3))
    send(theirs, Reply(True, TimeResult(samples_ms=[0.5, 0.25], mode="stream_events", sync_overhead_ms=0.01)))
    assert expect(recv(ours, time.monotonic() + 5), TimeResult).samples_ms == [0.5, 0.25]
    send(theirs, Reply(True, Health(canary_ok=True, allocated=0, baseline=0)))
    assert expect(recv(ours, time.monotonic() + 5), Health).canary_ok


def test_a_reply_of_the_wrong_model_is_a_bad_message(channel):
    ours, theirs = channel
    send(theirs, Reply(True, Health(canary_ok=True, allocated=0, baseline=0)))
    with pytest.raises(BadMessage, match="TrialOutput"):
        expect(recv(ours, time.monotonic() + 5), TrialOutput)
    forged = TrialOutput()
    forged.__dict__["failure"] = Health(canary_ok=True, allocated=0, baseline=0)  # unpickling sets fields unchecked
    send(theirs, Reply(True, forged))
    with pytest.raises(BadMessage, match="malformed"):
        expect(recv(ours, time.monotonic() + 5), TrialOutput)


@pytest.mark.parametrize("fields", [
    {"ok": False, "status": "PASSED"},             # an executor may fail its candidate, never pass it
    {"ok": False, "status": "NOT_A_STATUS"},
    {"ok": False, "reason": "made_up_reason"},
    {"ok": "yes"},
    {"ok": False, "error": ["not", "text"]},
    {"ok": True, "spent": {"call": float("nan")}},
    {"ok": True, "spent": ["call"]},
])
def test_a_reply_whose_own_fields_are_forged_is_a_bad_message(channel, fields):
    ours, theirs = channel
    forged = Reply(True)
    forged.__dict__.update(fields)  # unpickling sets fields unchecked: as a candidate's pickle would
    send(theirs, forged)
    with pytest.raises(BadMessage):
        checked(recv(ours, time.monotonic() + 5))


def test_a_failure_inside_a_reply_cannot_say_passed(channel):
    ours, theirs = channel
    forged = TrialOutput()
    forged.__dict__["failure"] = CandidateFailure.model_construct(status="PASSED", reason="exception", log="")
    send(theirs, Reply(True, forged))
    with pytest.raises(BadMessage, match="not a failing status"):
        expect(recv(ours, time.monotonic() + 5), TrialOutput)
    honest = TrialOutput(failure=CandidateFailure(status="RUNTIME_ERROR", reason="exception", log="boom"))
    send(theirs, Reply(True, honest))
    assert expect(recv(ours, time.monotonic() + 5), TrialOutput).failure.status == "RUNTIME_ERROR"


def test_a_file_descriptor_travels_after_its_request(channel, tmp_path):
    ours, theirs = channel
    path = tmp_path / "shared"
    path.write_bytes(b"region")
    fd = os.open(path, os.O_RDONLY)
    send(ours, Request(Op.ATTACH))
    send_fds(ours, [fd])
    assert recv(theirs, None, trusted=True).op == Op.ATTACH
    (got,) = recv_fds(theirs, 1)
    assert got != fd and os.read(got, 6) == b"region"
    os.close(got)
    os.close(fd)


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _forge(conn: Connection, body: bytes) -> None:
    msg = struct.pack("<I", 0) + body
    os.write(conn.fileno(), struct.pack("!i", len(msg)) + msg)


def test_a_forged_message_is_refused_without_running_it(channel, tmp_path):
    ours, theirs = channel
    mark = tmp_path / "ran"
    _forge(theirs, pickle.dumps(_Payload(str(mark)), protocol=5))
    with pytest.raises(BadMessage, match="system"):
        recv(ours, time.monotonic() + 5)
    assert not mark.exists()
    _forge(theirs, pickle.dumps(Reply(True, _Payload(str(mark))), protocol=5))  # nested in a real reply
    with pytest.raises(BadMessage):
        recv(ours, time.monotonic() + 5)
    assert not mark.exists()


def test_a_tensor_reference_outside_the_arena_is_refused(channel):
    ours, theirs = channel
    arena = Arena.create(1 << 20)

    class _Ref(pickle.Pickler):
        def persistent_id(self, obj):
            return ("arena", (1 << 20) - 8, 64, "float32", (16,), "cpu") if isinstance(obj, torch.Tensor) else None

    import io

    buf = io.BytesIO()
    _Ref(buf, protocol=5).dump(Reply(True, TrialOutput(draws=torch.zeros(16))))
    _forge(theirs, buf.getvalue())
    with pytest.raises(BadMessage, match="outside"):
        recv(ours, time.monotonic() + 5, arena)
    arena.close()


def test_a_message_that_stops_halfway_does_not_hold_its_reader_past_the_deadline(channel):
    ours, theirs = channel
    os.write(theirs.fileno(), struct.pack("!i", 1 << 20) + b"\0" * 16)  # 1 MiB announced, 16 bytes sent
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        recv(ours, time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("announce", ["frame", "frame64", "tensors"])
def test_a_message_announcing_more_than_a_reply_holds_is_refused_before_anything_is_allocated(channel, announce):
    """The supervisor would otherwise allocate whatever an executor announces (up to the host's memory)."""
    ours, theirs = channel
    if announce == "frame":
        os.write(theirs.fileno(), struct.pack("!i", MAX_REPLY_BYTES + 1))
    elif announce == "frame64":  # the long form Connection uses past 2 GiB
        os.write(theirs.fileno(), struct.pack("!iQ", -1, 64 << 30))
    else:
        body = struct.pack("<IQ", 1, MAX_REPLY_BYTES) + pickle.dumps(None, protocol=5)
        os.write(theirs.fileno(), struct.pack("!i", len(body)) + body)
    with pytest.raises(BadMessage, match="announced"):
        recv(ours, time.monotonic() + 5)


def test_the_executor_side_takes_its_supervisors_requests(channel):
    ours, theirs = channel
    send(ours, Request("health"))
    assert recv(theirs, None, trusted=True).op == "health"
