"""The serving scheduler on plain stand-in requests (no device): admissions, aborts, drained
batches and a full pool, decided as data."""

from __future__ import annotations

import types

from jdllm.serve.scheduler import Scheduler, SchedulerOutput


def _paradigm(joins: bool = True, ragged: bool = True):
    return types.SimpleNamespace(joins_running_batch=joins, ragged_lengths=ragged)


def _req(i: int, max_new: int = 8):
    return types.SimpleNamespace(id=i, status="waiting", row=None,
                                 sampling=types.SimpleNamespace(max_new_tokens=max_new))


def _ids(pairs):
    return [(r.id, row) for r, row in pairs]


def test_admissions_take_free_rows_in_order_and_wait_when_the_pool_is_full():
    s = Scheduler(_paradigm(), rows=2)
    reqs = [_req(i) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert _ids(out.admit) == [(0, 0), (1, 1)] and out.run_round and not out.start_batch
    assert [r.status for r in reqs] == ["running", "running", "waiting"]
    assert s.schedule() == SchedulerOutput(run_round=True)  # pool full: request 2 waits
    s.finish(1, reqs[1])
    out = s.schedule()
    assert _ids(out.admit) == [(2, 1)] and reqs[2].row == 1
    assert s.stats() == dict(rows=2, rows_busy=2, rows_free=0, waiting=0, tracked=2)
    s.finish(0, reqs[0])
    s.finish(1, reqs[2])
    assert not s.has_work() and s.schedule() == SchedulerOutput()


def test_aborts_of_waiting_and_running_requests():
    s = Scheduler(_paradigm(), rows=1)
    a, b, c = _req(0), _req(1), _req(2)
    for r in (a, b, c):
        s.add(r)
    s.schedule()  # a runs in row 0
    assert s.abort(a.id) and s.abort(b.id) and not s.abort(99)
    out = s.schedule()
    assert {r.id for r in out.aborted} == {0, 1} and out.close_rows == (0,)
    assert a.status == b.status == "aborted"
    assert _ids(out.admit) == [(2, 0)]  # the freed row goes to the next waiting request
    s.finish(0, c)
    assert not s.abort(c.id)  # finished: nothing to abort
    assert s.schedule() == SchedulerOutput() and s.stats()["tracked"] == 0


def test_drained_batches_start_together_with_the_heads_length():
    s = Scheduler(_paradigm(joins=False, ragged=False), rows=3)
    reqs = [_req(0, 8), _req(1, 8), _req(2, 4), _req(3, 8), _req(4, 8)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [r.id for r in out.start_batch] == [0, 1, 3] and not out.admit and out.run_round  # pool size 3
    assert [r.row for r in out.start_batch] == [0, 1, 2]
    s.finish(0, reqs[0])
    assert s.schedule() == SchedulerOutput(run_round=True)  # a free row, but the batch has not drained
    s.finish(1, reqs[1])
    s.finish(2, reqs[3])
    out = s.schedule()
    assert [r.id for r in out.start_batch] == [2] and s.stats()["rows_free"] == 2  # head asks for 4
    s.finish(0, reqs[2])
    assert [r.id for r in s.schedule().start_batch] == [4]


def test_drained_batches_of_a_ragged_paradigm_take_any_length():
    s = Scheduler(_paradigm(joins=False, ragged=True), rows=2)
    for r in (_req(0, 8), _req(1, 4), _req(2, 8)):
        s.add(r)
    assert [r.id for r in s.schedule().start_batch] == [0, 1]


def test_clear_forgets_everything():
    s = Scheduler(_paradigm(), rows=2)
    reqs = [_req(i) for i in range(3)]
    for r in reqs:
        s.add(r)
    s.schedule()
    s.abort(2)
    assert {r.id for r in s.clear()} == {0, 1, 2}
    assert not s.has_work() and s.stats() == dict(rows=2, rows_busy=0, rows_free=2, waiting=0, tracked=0)
