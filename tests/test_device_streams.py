"""mpidist.device._streams: CuPy stream objects for raw handles, made once per (handle, device),
through CuPy 14's Stream.from_external where it exists (no DeprecationWarning per call, which
CuPy 14's ExternalStream gave every CUDA-tensor op on an H200), ExternalStream before it.
A stand-in for the cupy module: no GPU needed."""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest

from mpidist.device import _streams

pytestmark = pytest.mark.mpi(min_size=1)


def fake_cupy(with_from_external: bool):
    made = []

    class Stream:
        null = "null-stream"

        def __init__(self, how, ptr, device):
            self.how, self.ptr, self.device = how, ptr, device

    if with_from_external:

        def from_external(obj):
            made.append(("from_external", obj.__cuda_stream__()))
            return Stream("from_external", obj.__cuda_stream__()[1], None)

        Stream.from_external = staticmethod(from_external)

    def external(ptr, device=-1):
        warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
        made.append(("ExternalStream", ptr, device))
        return Stream("ExternalStream", ptr, device)

    cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=external, Device=lambda d: contextlib.nullcontext())
    return types.SimpleNamespace(cuda=cuda), made


@pytest.fixture(autouse=True)
def empty_cache():
    _streams._cache.clear()
    yield
    _streams._cache.clear()


def test_from_external_once_per_handle():
    cp, made = fake_cupy(True)
    a = _streams.wrap(cp, 0x1234, 0)
    assert _streams.wrap(cp, 0x1234, 0) is a and a.how == "from_external" and a.ptr == 0x1234
    assert made == [("from_external", (0, 0x1234))]
    assert _streams.wrap(cp, 0x1234, 1) is not a  # another device: another object
    assert _streams.wrap(cp, 0, 0) == "null-stream"  # the legacy default stream


def test_external_stream_before_cupy_14_without_a_warning():
    cp, made = fake_cupy(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = _streams.wrap(cp, 0x99, 2)
    assert (s.how, s.ptr, s.device) == ("ExternalStream", 0x99, 2) and made == [("ExternalStream", 0x99, 2)]


def test_the_cache_is_bounded(monkeypatch):
    cp, made = fake_cupy(True)
    monkeypatch.setattr(_streams, "LIMIT", 4)
    for ptr in range(1, 10):
        _streams.wrap(cp, ptr)
    assert len(_streams._cache) <= 4
