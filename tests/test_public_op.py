"""mpidist._public_op: each public op's entry (group, device detour, body), compiled once."""

import inspect

import numpy as np
import pytest

from mpidist._core import current
from mpidist._public_op import public_op


def test_the_body_must_take_the_stubs_parameters():
    def all_reduce(tensor, g):  # misses op, async_op
        return None

    with pytest.raises(
        TypeError,
        match=r"public_op entry: body .*all_reduce must take \['tensor', 'op', 'g', "
        r"'async_op'\], got \['tensor', 'g'\]",
    ):

        @public_op(all_reduce)
        def entry(tensor, op=None, group=None, async_op=False):
            """A stub."""


def test_the_stub_holds_no_code():
    def all_reduce(tensor, g):
        return None

    with pytest.raises(TypeError, match=r"public_op entry: the stub must hold only its signature and docstring"):

        @public_op(all_reduce)
        def entry(tensor, group=None):
            """A stub with a body that would never run."""
            return np.asarray(tensor)


def _entry_over(calls: list):
    def all_reduce(tensor, op, g, async_op, algorithm):
        calls.append((tensor, op, g, async_op, algorithm))
        return "body ran"

    @public_op(all_reduce)
    def entry(tensor: np.ndarray, op: str = "sum", group=None, async_op: bool = False, *, algorithm: str = "x") -> str:
        """The stub's docstring."""

    return entry


def test_the_entry_keeps_the_stubs_signature_and_docstring():
    entry = _entry_over([])
    assert str(inspect.signature(entry)) == (
        "(tensor: numpy.ndarray, op: str = 'sum', group=None, async_op: bool = False, *, algorithm: str = 'x') -> str"
    )
    assert entry.__doc__ == "The stub's docstring."
    assert entry.__name__ == "entry" and entry.__module__ == __name__


def test_the_body_gets_the_resolved_group_and_the_arguments_by_position(dist, world):
    calls: list = []
    entry = _entry_over(calls)
    x = np.zeros(2, np.float32)
    assert entry(x, "max", None, True, algorithm="ring") == "body ran"
    assert calls[-1] == (x, "max", current.state.world, True, "ring")
    assert entry(x) == "body ran"
    assert calls[-1] == (x, "sum", current.state.world, False, "x")


@pytest.mark.mpi(min_size=2)
def test_a_non_member_returns_none_without_the_body(dist, world):
    rank, size = world
    g = dist.new_group([0])
    calls: list = []
    out = _entry_over(calls)(np.zeros(2, np.float32), group=g)
    if rank == 0:
        assert out == "body ran" and calls[-1][2] is not None
    else:
        assert out is None and calls == []
