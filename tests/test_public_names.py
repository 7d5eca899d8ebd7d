"""Public names that torch.distributed has and mpidist's internal modules must not shadow."""

from __future__ import annotations

import types
import warnings

import pytest

import mpidist


def test_reduce_op_is_torchs_deprecated_alias_not_a_module():
    assert not isinstance(mpidist.reduce_op, types.ModuleType)
    with pytest.warns(FutureWarning, match="mpidist.ReduceOp"):
        assert mpidist.reduce_op.SUM is mpidist.ReduceOp.SUM
    with pytest.warns(FutureWarning):
        assert set(mpidist.reduce_op.__members__) == set(mpidist.ReduceOp.__members__)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(AttributeError, match="no member 'NOPE'"):
            mpidist.reduce_op.NOPE  # noqa: B018


def test_group_is_torchs_group_class_not_a_module():
    assert not isinstance(mpidist.group, types.ModuleType)
    assert hasattr(mpidist.group, "WORLD")


def test_no_public_name_is_an_internal_module():
    for name in mpidist.__all__:
        assert hasattr(mpidist, name), name
    shadowed = [n for n in mpidist.__all__ if isinstance(getattr(mpidist, n), types.ModuleType)]
    assert shadowed == []
