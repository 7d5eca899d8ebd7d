"""A ``torch.distributed.Store`` served over MPI: no listening socket, no shared file system.

:class:`MPIStore` is served by a thread on rank 0 of a duplicate of ``MPI_COMM_WORLD``; every
rank asks it over MPI point-to-point messages. Semantics are ``torch.distributed.Store``'s
(values are bytes, ``str`` encoded as UTF-8; a blocking read past the timeout raises
``torch.distributed.DistStoreError`` naming the keys, on the caller only). Making it is
collective over the communicator; it needs ``MPI_THREAD_MULTIPLE``. Ordering, faults and the
pip MPICH stall: docs/torch.md, "The store over MPI".
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional, cast

import torch.distributed as dist
from mpi4py import MPI

__all__ = ["MPIStore"]

_REQUEST, _REPLY = 1, 2
#: writes the server does not answer (as TCPStore's set): a process's requests reach rank 0
#: in the order it sent them (MPI's non-overtaking rule), so its own later reads see them
_UNANSWERED = frozenset({"set", "multi_set", "append"})
_DEFAULT_TIMEOUT = timedelta(minutes=30)
#: polling: spin (yielding the GIL and the core) for _HOT s after the last message, then
#: sleep with a back-off from _MIN_PAUSE to _BUSY_PAUSE s while the store was used in the last
#: _BUSY s (a rendezvous: requests come in bursts), to _MAX_PAUSE s after that (an idle
#: server wakes ~500 times a second)
_HOT, _MIN_PAUSE, _BUSY_PAUSE, _BUSY, _MAX_PAUSE = 2e-3, 5e-5, 2e-4, 1.0, 2e-3


def _bytes(value: Any, op: str, arg: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value)  # torch's C++ side hands std::vector<uint8_t> as a list of ints
    raise TypeError(f"MPIStore.{op}: {arg} must be bytes or str, got {type(value).__name__}")


def _key(key: Any, op: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"MPIStore.{op}: key must be a str, got {type(key).__name__}")
    return key


class _Server:
    """Rank 0's table and the thread that answers every rank's requests."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.data: dict[str, bytes] = {}
        self.waiting: list[tuple[int, int, str, list[str]]] = []  # (rank, request id, op, keys) blocked on keys
        self.sends: list[MPI.Request] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="mpidist-store", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        pause, last = _MIN_PAUSE, time.monotonic()
        while not self.stopped.is_set():
            msg = self.comm.improbe(MPI.ANY_SOURCE, _REQUEST)
            if msg is None:
                self.sends = [r for r in self.sends if not r.Test()]
                idle = time.monotonic() - last
                if idle < _HOT:
                    time.sleep(0)
                    continue
                time.sleep(pause)
                pause = min(2 * pause, _BUSY_PAUSE if idle < _BUSY else _MAX_PAUSE)
                continue
            pause, last = _MIN_PAUSE, time.monotonic()
            status = MPI.Status()
            rid, op, args = msg.recv(status=status)
            self._serve(status.Get_source(), rid, op, args)

    def _reply(self, rank: int, rid: int, ok: bool, value: Any) -> None:
        self.sends.append(self.comm.isend((rid, ok, value), rank, _REPLY))

    def _serve(self, rank: int, rid: int, op: str, args: tuple[Any, ...]) -> None:
        data = self.data
        try:
            if op in ("get", "multi_get", "wait"):
                keys = list(args[0])
                if all(k in data for k in keys):
                    self._reply(rank, rid, True, self._blocked_value(op, keys))
                else:
                    self.waiting.append((rank, rid, op, keys))
                return
            if op == "set":
                data[args[0]] = args[1]
                value: Any = None
            elif op == "multi_set":
                data.update(zip(args[0], args[1]))
                value = None
            elif op == "add":
                value = int(data.get(args[0], b"0")) + args[1]
                data[args[0]] = str(value).encode()
            elif op == "compare_set":
                key, expected, desired = args
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = current = desired
                value = expected if current is None else current
            elif op == "append":
                data[args[0]] = data.get(args[0], b"") + args[1]
                value = None
            elif op == "check":
                value = all(k in data for k in args[0])
            elif op == "delete_key":
                value = data.pop(args[0], None) is not None
            elif op == "num_keys":
                value = len(data)
            else:
                raise ValueError(f"unknown store operation {op!r}")
        except (ValueError, TypeError) as exc:  # e.g. add to a key that holds no integer
            self._reply(rank, rid, False, f"{type(exc).__name__}: {exc}")  # (the writes raise none)
            return
        if op not in _UNANSWERED:
            self._reply(rank, rid, True, value)
        if self.waiting and op in ("set", "multi_set", "add", "compare_set", "append"):
            still = []
            for rank_, rid_, op_, keys in self.waiting:
                if all(k in data for k in keys):
                    self._reply(rank_, rid_, True, self._blocked_value(op_, keys))
                else:
                    still.append((rank_, rid_, op_, keys))
            self.waiting = still

    def _blocked_value(self, op: str, keys: list[str]) -> Any:
        if op == "get":
            return self.data[keys[0]]
        if op == "multi_get":
            return [self.data[k] for k in keys]
        return None

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)


class MPIStore(dist.Store):
    """A ``torch.distributed.Store`` served over MPI by rank 0 (see the module).

    Args:
        timeout: how long ``get``, ``multi_get`` and ``wait`` (without their own timeout)
            block, and how long any request waits for rank 0's answer; torch's
            ``set_timeout`` changes it.
        comm: the communicator whose rank 0 serves (default ``MPI.COMM_WORLD``); it is
            duplicated, collectively over its ranks, so the store's messages never meet
            anyone else's.

    Raises:
        RuntimeError: MPI gives less than ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, timeout: timedelta = _DEFAULT_TIMEOUT, comm: Optional[MPI.Comm] = None) -> None:
        super().__init__()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "MPIStore needs MPI_THREAD_MULTIPLE (rank 0 serves the store on a thread while "
                "it works); this MPI gives less"
            )
        base = MPI.COMM_WORLD if comm is None else comm
        self._comm = base.Dup()
        self._rank = self._comm.Get_rank()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one request in flight per process: answers come in order
        self._sent: list[MPI.Request] = []  # the unanswered writes' sends, until they complete
        self._closed = False
        self._server = _Server(self._comm) if self._rank == 0 else None
        self.set_timeout(timeout)
        atexit.register(self.close)

    # -- the client side: one request, its answer ------------------------------------------
    # (rank 0 answers each op with the type torch's Store gives: the methods below cast to it)
    def _ask(self, op: str, args: tuple[Any, ...], limit: Optional[timedelta] = None, keys: Sequence[str] = ()) -> Any:
        if self._closed:
            raise RuntimeError(f"MPIStore.{op}: the store is closed")
        secs = (self.timeout if limit is None else limit).total_seconds()  # type: ignore[attr-defined]  # Store.timeout: torch's C++ property, missing from its stub
        deadline = time.monotonic() + (secs if secs > 0 else float("inf"))
        with self._lock:
            rid = next(self._ids)
            send = self._comm.isend((rid, op, args), 0, _REQUEST)
            if op in _UNANSWERED:
                self._sent = [r for r in self._sent if not r.Test()]
                self._sent.append(send)
                return None
            pause, hot = _MIN_PAUSE, time.monotonic() + _HOT
            while True:
                if self._comm.iprobe(0, _REPLY):
                    got, ok, value = self._comm.recv(source=0, tag=_REPLY)
                    if got == rid:
                        break
                    continue  # the late answer to a request that timed out
                if time.monotonic() >= deadline:
                    send.Test()
                    what = f" for keys {list(keys)}" if keys else ""
                    raise dist.DistStoreError(
                        f"[rank {self._rank}] MPIStore.{op}: no answer within the timeout of {secs:g} s{what}"
                        + (" (the keys were never set)" if keys else " (rank 0 did not answer)")
                    )
                if time.monotonic() < hot:
                    time.sleep(0)
                    continue
                time.sleep(pause)
                pause = min(2 * pause, _BUSY_PAUSE)  # the caller waits: at most 5000 wake-ups a second
            send.Wait()
        if not ok:
            raise ValueError(f"[rank {self._rank}] MPIStore.{op}: {value}")
        return value

    # -- torch.distributed.Store -----------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._ask("set", (_key(key, "set"), _bytes(value, "set", "value")))

    def get(self, key: str) -> bytes:
        key = _key(key, "get")
        return cast(bytes, self._ask("get", ([key],), keys=[key]))

    def add(self, key: str, amount: int) -> int:
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"MPIStore.add: amount must be an int, got {type(amount).__name__}")
        return cast(int, self._ask("add", (_key(key, "add"), amount)))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return cast(
            bytes,
            self._ask(
                "compare_set",
                (
                    _key(key, "compare_set"),
                    _bytes(expected_value, "compare_set", "expected_value"),
                    _bytes(desired_value, "compare_set", "desired_value"),
                ),
            ),
        )

    def append(self, key: str, value: Any) -> None:
        self._ask("append", (_key(key, "append"), _bytes(value, "append", "value")))

    def check(self, keys: Sequence[str]) -> bool:
        return cast(bool, self._ask("check", ([_key(k, "check") for k in keys],)))

    def wait(self, keys: Sequence[str], timeout: Optional[timedelta] = None) -> None:
        keys = [_key(k, "wait") for k in keys]
        self._ask("wait", (keys,), timeout, keys)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = [_key(k, "multi_get") for k in keys]
        return cast("list[bytes]", self._ask("multi_get", (keys,), keys=keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(f"MPIStore.multi_set: {len(keys)} keys but {len(values)} values")
        self._ask(
            "multi_set", ([_key(k, "multi_set") for k in keys], [_bytes(v, "multi_set", "values") for v in values])
        )

    def delete_key(self, key: str) -> bool:
        return cast(bool, self._ask("delete_key", (_key(key, "delete_key"),)))

    def num_keys(self) -> int:
        return cast(int, self._ask("num_keys", ()))

    def has_extended_api(self) -> bool:
        return True

    # the names torch's C++ side calls through its trampoline
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def close(self) -> None:
        """Stop serving (rank 0) and refuse further requests. Local; at exit too. The
        communicator is kept until MPI finalizes: a last unanswered write still on its way
        could otherwise reach a later communicator reusing its context id."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.stop()
