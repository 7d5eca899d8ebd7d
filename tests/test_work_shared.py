"""The machinery the Work kinds share (mpidist.work.Work): the flag-completed future that
CompletedWork and the NCCL path's NcclWork use, poll_until (the one bounded poll loop), and
_follow (the derived future of FutureWork and the device paths' DeviceWork)."""

from __future__ import annotations

import concurrent.futures

import pytest

from mpidist._core import recorder as R
from mpidist.errors import DistError
from mpidist.work import Work, poll_until


class FlagWork(Work):
    """A Work completed by ``_finished()``, as NcclWork is by its completion thread."""

    def __init__(self, outputs: tuple = (), source=None) -> None:
        super().__init__("irecv", "[rank 0/1] irecv:")
        self._outs, self._source = outputs, source


def test_flag_work_future_settles_on_finished() -> None:
    w = FlagWork((1, 2), source=3)
    assert not w.is_completed() and not w.is_success() and w.exception() is None
    fut = w.get_future()
    assert fut is w.get_future() and not fut.done()
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.result()))
    w._finished()
    assert seen == [[1, 2]] and w.is_completed() and w.is_success()
    assert w.source_rank() == 3 and w._outputs() == (1, 2)


def test_flag_work_future_taken_after_finished() -> None:
    w = FlagWork((5,))
    w._finished()
    assert w.get_future().result(0) == [5]


def test_source_rank_of_a_non_receive() -> None:
    with pytest.raises(ValueError, match=r"\[rank 0/1\] irecv: source_rank\(\) is only defined for receive operations"):
        FlagWork().source_rank()


def test_poll_until() -> None:
    calls = []
    assert poll_until(lambda: calls.append(1) or len(calls) == 3, (), None, 1e-6, 1e-5)
    assert len(calls) == 3
    assert poll_until(lambda: False, (), 0.01) is False


def test_poll_until_raises_the_watchdogs_error() -> None:
    rec = [None] * 12
    rec[R.STATE], rec[R.INFO] = R.STARTED, None
    assert poll_until(lambda: False, (rec,), 0.01) is False  # not declared: a plain timeout
    rec[R.STATE], rec[R.INFO] = R.TIMED_OUT, "all_reduce timed out (the watchdog's text)"
    with pytest.raises(DistError, match=r"the watchdog's text"):
        poll_until(lambda: False, (rec,))


def test_follow_settles_once_from_the_source() -> None:
    w = FlagWork((7,))
    src: concurrent.futures.Future = concurrent.futures.Future()
    fut = w._follow(lambda: src, lambda f: (f.exception(), w._outs))
    assert w._follow(lambda: src, lambda f: (None, ())) is fut
    src.set_result(None)
    assert fut.result(0) == [7]
    err = ValueError("boom")
    w2 = FlagWork()
    src2: concurrent.futures.Future = concurrent.futures.Future()
    fut2 = w2._follow(lambda: src2, lambda f: (f.exception(), ()))
    src2.set_exception(err)
    assert fut2.exception(0) is err
