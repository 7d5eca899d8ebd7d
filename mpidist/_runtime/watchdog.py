"""The timeout watchdog: one daemon thread per process while initialized.

Every tick it trips an op in flight (each group's ``engine.current``, and
:data:`mpidist._core.recorder.watched`) older than its timeout, and warns of one older than
``MPIDIST_STALL_WARNING`` (the stall inspector: :meth:`_Watchdog._stall`); it answers its peers' probes
on a duplicate of the world (and the mismatch check's questions: :meth:`_Watchdog.check_probe`,
:meth:`_Watchdog.notify_mismatch`), and sees SIGTERM through ``signal.set_wakeup_fd``, so a
rank stuck in MPI still writes its flight recorder. Started and stopped by
:mod:`mpidist._runtime.world`; the running one is :data:`mpidist._core.current.watchdog`.
docs/reliability.md, sections 2 and 3.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import socket
import threading
import time
from typing import Any, Optional, cast

from mpi4py import MPI

from mpidist import work
from mpidist._check import mismatch
from mpidist._core import current as _current, recorder as R
from mpidist._core.current import live_groups
from mpidist._launch import abort as _abort
from mpidist._launch.abort import abort_job
from mpidist._launch.mpi_init import env_seconds
from mpidist.errors import prefix

__all__ = ["start", "stop", "leaving", "STALL_ENV"]

_PROBE, _REPLY, _ACK, _CHECK = 1, 2, 3, 4  # tags on the watchdog's communicator
#: The communicators of stopped watchdogs (see :meth:`_Watchdog.stop`).
_RETIRED: list = []
#: Watchdog sends still pending when it stopped (kept, with their buffers, to the end of the process).
_UNSENT: list = []
_SENDS_GRACE = 1.0  # seconds stop() waits for its pending sends
_MAX_MSG = 1 << 16
#: s after a SIGTERM the program handles until a rank still alive (stuck in MPI?) writes its recorder
SIGTERM_GRACE = 10.0
STALL_ENV = "MPIDIST_STALL_WARNING"  # s an op waits before the stall inspector speaks (0: never)


def _say(text: str) -> None:
    """Write ``text`` (lines prefixed with the rank) to stderr at once."""
    st = _current.state
    _abort.write(st.rank if st is not None else None, text)


class _Watchdog:
    def __init__(self, st: Any) -> None:
        self.st = st
        self.comm = st.world.comm.Dup() if st.world_size > 1 and st.thread_multiple else None
        self.tick = min(0.2, R.timeout / 10)  # a wake-up costs ~20 us: 0.01% of a core
        self.probe_wait = min(5.0, max(1.0, R.timeout / 2))
        self.stopped = threading.Event()
        self.tripped: set = set()
        self.warned: set = set()  # ids of the entries the stall inspector spoke of
        self.gone: set = set()  # the ranks whose watchdog said goodbye (destroyed the world, or exited)
        self.leaving = False  # in the final comparison of destroy_process_group() or exit
        self.gave_up = False  # a final comparison gave up on a peer (mpidist._check.mismatch._wait)
        self.stall = env_seconds(STALL_ENV, 60.0, True)
        self.sends: list = []
        self.lock = threading.Lock()
        self.nonce = 0
        self.sigterm_done = False
        self.sigterm_at = 0.0  # when the program's own handler got SIGTERM (monotonic s; 0: not yet)
        self.check_lock = threading.Lock()  # one mismatch question at a time: answers of two would share the tag
        self.sigterm_lock = threading.RLock()  # RLock: the handler may interrupt its own thread
        self.own_handler = False
        self.rsock: Optional[socket.socket] = None
        self.wsock: Optional[socket.socket] = None
        self.req = self.comm.irecv(bytearray(_MAX_MSG), MPI.ANY_SOURCE, _PROBE) if self.comm else None
        self._install_signals()
        self.thread = threading.Thread(target=self._loop, name="mpidist-watchdog", daemon=True)
        self.thread.start()

    # -- signals ---------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self.own_handler = True
        rsock, wsock = socket.socketpair()
        rsock.setblocking(False)
        wsock.setblocking(False)
        try:
            old = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = -2
        if old != -1:  # someone else (asyncio) owns the wakeup fd: leave it to them
            if old != -2:
                signal.set_wakeup_fd(old)
            rsock.close()
            wsock.close()
            return
        self.rsock, self.wsock = rsock, wsock

    def _sigterm_dump(self) -> None:
        """Once per process (the main thread's handler and the watchdog may both get here):
        write this rank's recorder and ask the others to write theirs, waiting at most 1 s,
        so that a peer is not killed by the launcher before it has written its own."""
        with self.sigterm_lock:
            if not self.sigterm_done:
                self.sigterm_done = True
                path = R.dump("SIGTERM")
                with contextlib.suppress(Exception):  # the process is being terminated
                    self.dump_all("SIGTERM", 1.0)
                _say(f"SIGTERM: {R.report(path)}")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """mpidist's SIGTERM handler (main thread): dump the recorder, then die of SIGTERM."""
        self._sigterm_dump()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _signalled(self) -> None:
        """Seen by the watchdog through the wakeup fd: the main thread may be stuck in MPI,
        where its Python handler cannot run; dump now and, if the handler is mpidist's and
        has not ended the process within a second, end it as SIGTERM would."""
        try:
            data = cast(socket.socket, self.rsock).recv(64)  # (called only when the loop found rsock ready)
        except (BlockingIOError, OSError):
            return
        if signal.SIGTERM not in data:
            return
        if not self.own_handler:  # the program's: a clean stop (checkpoint, then exit) dumps nothing
            self.sigterm_at = self.sigterm_at or time.monotonic()
            return
        self._sigterm_dump()
        if self.own_handler and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            time.sleep(1.0)
            os._exit(128 + signal.SIGTERM)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.own_handler and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.wsock is not None:
            current = signal.set_wakeup_fd(-1)
            if current != self.wsock.fileno():  # someone replaced ours since: keep theirs
                signal.set_wakeup_fd(current)
            cast(socket.socket, self.rsock).close()  # (set together with wsock)
            self.wsock.close()

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopped.is_set():
            if self.rsock is not None:
                ready, _, _ = select.select([self.rsock], [], [], self.tick)
                if ready:
                    self._signalled()
                if self.sigterm_at and time.monotonic() - self.sigterm_at > SIGTERM_GRACE:
                    self.sigterm_at = 0.0  # the program's handler has not ended it: stuck in MPI?
                    self._sigterm_dump()
            else:
                self.stopped.wait(self.tick)
            if self.stopped.is_set():
                return
            try:
                self._serve()
                self._check()
            except Exception as exc:  # noqa: BLE001  (the watchdog must not die silently)
                if not self.stopped.is_set():
                    _say(f"mpidist watchdog: {type(exc).__name__}: {exc}")

    def _check(self) -> None:
        now = R._now()
        recs = [g.engine.current for g in live_groups()] + list(R.watched.values())
        for rec in recs:
            if rec is None or rec[R.STATE] is not R.STARTED or id(rec) in self.tripped:
                continue
            if now - rec[R.T_ISSUE] > rec[R.LIMIT]:
                self._trip(rec)
            elif self.stall and now - rec[R.T_ISSUE] > self.stall and id(rec) not in self.warned:
                self._stall(rec, now - rec[R.T_ISSUE])

    # -- probes ----------------------------------------------------------------------------
    def _send(self, msg: tuple, dest: int, tag: int) -> None:
        """isend ``msg``; the request is kept (with its buffer) until it completes."""
        with self.lock:  # the watchdog thread and dump_all (main thread) both send
            self.sends = [s for s in self.sends if not s.Test()]
            self.sends.append(self.comm.isend(msg, dest, tag))  # type: ignore[union-attr]  # only sent with a comm

    def _serve(self) -> None:
        """Answer the probes and dump requests that arrived."""
        if self.req is None:
            return
        while True:
            status = MPI.Status()
            flag, msg = self.req.test(status)
            if not flag:
                return
            self.req = self.comm.irecv(bytearray(_MAX_MSG), MPI.ANY_SOURCE, _PROBE)  # type: ignore[union-attr]  # req: with comm
            self._answer(status.Get_source(), msg)

    def _answer(self, src: int, msg: tuple) -> None:
        kind, nonce = msg[0], msg[1]
        if kind == "dump":
            R.dump(msg[2])
            self._send(("ack", nonce), src, _ACK)
        elif kind in ("probe", "stall"):  # a peer's op timed out (dump), or stalls (no dump)
            _, _, key, seq, reason = msg
            if kind == "probe":
                R.dump(f"rank {src} timed out: {reason}")
            self._send(("state", nonce, self._state_of(key, seq)), src, _REPLY)
        elif kind == "bye":
            self.gone.add(src)
        elif kind == "check":  # a peer's mismatch check stalls at collective ``seq`` (mpidist._check.mismatch)
            _, _, key, seq = msg
            info = self._state_of(key, seq)
            info.update(mismatch.probe_answer(_group_of(key), seq))
            self._send(("state", nonce, info), src, _CHECK)
        elif kind == "mismatch":  # that peer found this rank's call at ``seq`` differs from its own
            self._mismatch(src, *msg[2:])

    def _mismatch(self, src: int, key: str, seq: int, text: str) -> None:
        """Peer ``src`` found that this rank's collective ``seq`` of group ``key`` mismatches its
        own (``text``): end this rank's op as a timeout does."""
        g = _group_of(key)
        if g is None:
            return
        rec = g.engine.current
        at = next(
            (r for r in reversed(list(R._ring)) if r[R.GROUP] is g and r[R.SEQ] == seq and r[R.OP] not in R.P2P_OPS),
            None,
        )
        line = f"{prefix(at[R.OP] if at is not None else 'collective')} {text}"
        path = R.dump(f"mismatch: {line}")
        live = rec is not None and rec[R.STATE] in (R.STARTED, R.SCHEDULED) and id(rec) not in self.tripped
        if work.ABORT_ON_TIMEOUT or (live and id(rec) in R.unbounded):
            _say(
                f"mpidist.errors.DistError: {line}\n"
                f"{'flight recorder written to ' + path + '; ' if path else ''}aborting the job "
                f"(set MPIDIST_ABORT_ON_TIMEOUT=0 to raise the DistError in the caller instead)"
            )
            abort_job(1)
        mismatch.broken(g, f"a mismatched collective at sequence number {seq}: {text}")
        if live:
            self.tripped.add(id(rec))
            rec[R.STATE] = R.TIMED_OUT
            rec[R.INFO] = line  # the waiting caller raises DistError(line)

    def _state_of(self, key: str, seq: int) -> dict:
        """What this rank can say about group ``key`` and its collective ``seq``."""
        now = R._now()
        ring = list(R._ring)
        g = _group_of(key)
        info: dict = {"member": g is not None, "latest": R.describe(ring[-1], now) if ring else None}
        info["leaving"] = self.leaving
        if g is not None:
            eng = g.engine
            info["issued"] = eng.seq
            info["current"] = R.describe(eng.current, now) if eng.current is not None else None
            at = next(
                (r for r in reversed(ring) if r[R.GROUP] is g and r[R.SEQ] == seq and r[R.OP] not in R.P2P_OPS), None
            )
            info["at_seq"] = (at[R.OP], at[R.STATE]) if at is not None else None
        return info

    def _ask(self, peers: list, msg: tuple, reply_tag: int, wait: float) -> dict:
        """Send ``msg`` (its [1] is the nonce) to ``peers``; their answers within ``wait`` s."""
        nonce = msg[1]
        reqs = {}
        for p in peers:
            self._send(msg, p, _PROBE)
            reqs[p] = self.comm.irecv(bytearray(_MAX_MSG), p, reply_tag)  # type: ignore[union-attr]  # callers check comm
        answers: dict = {}
        deadline = time.monotonic() + wait
        while reqs and time.monotonic() < deadline:
            for p, req in list(reqs.items()):
                flag, got = req.test()
                if not flag:
                    continue
                if got[1] == nonce:
                    answers[p] = got[2] if len(got) > 2 else True
                    del reqs[p]
                else:  # a late answer to an earlier question
                    reqs[p] = self.comm.irecv(bytearray(_MAX_MSG), p, reply_tag)  # type: ignore[union-attr]  # (see above)
            if threading.current_thread() is self.thread:
                self._serve()
            time.sleep(0.005)
        for req in reqs.values():
            with contextlib.suppress(MPI.Exception):
                req.Cancel()
                req.Wait()
        return answers

    def _next_nonce(self) -> tuple:
        with self.lock:
            self.nonce += 1
            return (self.st.rank, self.nonce, time.time())

    # -- tripping --------------------------------------------------------------------------
    def _ask_peers(self, rec: list, kind: str, reason: str) -> tuple[list, Optional[dict]]:
        """The global ranks ``rec`` waits for (every other member for a collective or a receive
        from any rank), and their answers to a ``kind`` question (None without a channel)."""
        g, p2p = rec[R.GROUP], rec[R.OP] in R.P2P_OPS
        peers = [rec[R.ROOT]] if p2p and rec[R.ROOT] >= 0 else [r for r in g.ranks if r != self.st.rank]
        if self.comm is None or not peers:
            return peers, None
        msg = (kind, self._next_nonce(), R.group_key(g), -1 if p2p else rec[R.SEQ], reason)
        return peers, self._ask(peers, msg, _REPLY, self.probe_wait)

    def _trip(self, rec: list) -> None:
        self.tripped.add(id(rec))
        reason = f"{rec[R.OP]} #{rec[R.SEQ]} on group {rec[R.GROUP].group_name!r}"
        peers, answers = self._ask_peers(rec, "probe", reason)
        self._end(rec, _timeout_message(rec, peers, answers), "timeout")

    def _stall(self, rec: list, waited: float) -> None:
        """The stall inspector (after Horovod's; docs/reliability.md, section 2): ``rec`` has
        waited ``waited`` s. Say once, in one line, what it waits for and what those ranks are
        doing; where they can never arrive (they left the job: in the final comparison of
        destroy_process_group() or exit, or past it), end it as a timeout does."""
        self.warned.add(id(rec))
        peers, answers = self._ask_peers(rec, "stall", "")
        text = _timeout_message(rec, peers, answers, f"has waited {waited:.0f} s ({STALL_ENV})")
        said = answers or {}
        lost = [p for p in peers if p in self.gone or said.get(p, {}).get("leaving")]
        if rec[R.OP] not in R.P2P_OPS:  # a peer that ran this collective and then left is no loss
            lost = [p for p in lost if p in self.gone or said[p].get("issued", 0) <= rec[R.SEQ]]
        elif rec[R.ROOT] < 0 and len(lost) < len(peers):  # a receive from any rank: one may still send
            lost = []
        if not lost or rec[R.OP] in mismatch.FINAL_OPS:  # (a final comparison gives up by itself)
            _say(f"mpidist stall inspector: {text}")
            return
        self._end(rec, f"{text}; rank(s) {lost} left the job and can never arrive", "stall")

    def _end(self, rec: list, text: str, why: str) -> None:
        """End ``rec`` (timed out, or waiting for a rank that left) with the DistError ``text``:
        the job is aborted, or the waiting caller raises it."""
        g, op, seq, p2p = rec[R.GROUP], rec[R.OP], rec[R.SEQ], rec[R.OP] in R.P2P_OPS
        self.tripped.add(id(rec))
        rec[R.STATE] = R.TIMED_OUT  # (the op may still complete: then it is marked so)
        text = f"{text}. {R.report(R.dump(f'{why}: {text}'))}"
        if work.ABORT_ON_TIMEOUT:
            _say(
                f"mpidist.errors.DistError: {text}\naborting the job (set MPIDIST_ABORT_ON_TIMEOUT=0 to raise "
                f"the DistError in the caller instead)"
            )
            abort_job(1)
        if id(rec) in R.unbounded:
            _say(
                f"mpidist.errors.DistError: {text}\naborting the job although MPIDIST_ABORT_ON_TIMEOUT=0: the "
                f"op was issued from a callback and runs on its group's engine thread, where no caller "
                f"can be given the error"
            )
            abort_job(1)
        if not p2p:
            how = "timed out" if why == "timeout" else "waits for a rank that left"
            g.engine.broken = f"{op} #{seq} {how}; destroy the group (or exit)"
        rec[R.INFO] = text  # the waiting caller raises DistError(text) once it is set

    def check_probe(self, g: Any, seq: int, wait: Optional[float] = None) -> dict:
        """Ask every other member of ``g`` what it did at collective ``seq``
        (:func:`mpidist._check.mismatch.probe_answer` plus its state there); the answers within
        ``wait`` seconds (default: the probe wait), by global rank. Empty without a channel
        (one rank, or no MPI_THREAD_MULTIPLE)."""
        if self.comm is None:
            return {}
        peers = [r for r in g.ranks if r != self.st.rank]
        with self.check_lock:
            return self._ask(
                peers,
                ("check", self._next_nonce(), R.group_key(g), seq),
                _CHECK,
                self.probe_wait if wait is None else wait,
            )

    def notify_mismatch(self, g: Any, peers: list, seq: int, text: str) -> None:
        """Tell ``peers`` (global ranks) that their collective ``seq`` on ``g`` mismatches
        (``text``); their watchdogs end their op with it (see :meth:`_mismatch`)."""
        if self.comm is None:
            return
        for p in peers:
            self._send(("mismatch", self._next_nonce(), R.group_key(g), seq, text), p, _PROBE)

    def dump_all(self, reason: str, wait: float) -> None:
        if self.comm is None:
            return
        peers = [r for r in range(self.st.world_size) if r != self.st.rank]
        self._ask(peers, ("dump", self._next_nonce(), reason), _ACK, wait)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        self._restore_signals()
        if self.comm is not None:
            if self.gave_up:  # goodbye: a peer's op waiting for this rank stalls for good (else every
                for p in range(self.st.world_size):  # member passed the final comparison: none waits, and
                    if p != self.st.rank:  # no message is left unreceived, which UCX warns of at exit)
                        self._send(("bye", self._next_nonce()), p, _PROBE)
            with contextlib.suppress(MPI.Exception):
                cast(MPI.Request, self.req).Cancel()  # (req is made with comm)
                cast(MPI.Request, self.req).Wait()
            # The sends complete (small messages: at once, or when a live peer takes them) within a
            # bound; one to a peer that is gone may never complete: kept with its buffer, never freed
            # (freeing it let its buffer go while MPI could still read it: a crash, seen in the suite)
            until = time.monotonic() + _SENDS_GRACE
            pending = self.sends
            with contextlib.suppress(MPI.Exception):
                while pending and time.monotonic() < until:
                    pending = [s for s in pending if not s.Test()]
                    if pending:
                        time.sleep(1e-3)
            _UNSENT.extend(pending)
            self.sends = []
            # Not freed: a peer's message may still be on its way, and a later communicator
            # reusing the context id would receive it (seen in torch's suite: a test's
            # irecv(tag=1) got an earlier test's probe). One context id per init.
            _RETIRED.append(self.comm)
            self.comm = None


def _shape_text(rec: list) -> str:
    parts = []
    if rec[R.SHAPES] is not None:
        parts.append(f"shape {rec[R.SHAPES]}" if isinstance(rec[R.SHAPES], tuple) else f"shapes {rec[R.SHAPES]}")
    if rec[R.DTYPE] is not None:
        parts.append(f"dtype {rec[R.DTYPE]}")
    if rec[R.ROOT] >= 0 and rec[R.OP] not in R.P2P_OPS:
        parts.append(f"root {rec[R.ROOT]}")
    return f" ({', '.join(parts)})" if parts else ""


def _timeout_message(rec: list, peers: list, answers: Optional[dict], what: str = "") -> str:
    """The DistError text for ``rec`` past its timeout (or, ``what``, the stall inspector's
    line), with what the peers said."""
    g, op, seq = rec[R.GROUP], rec[R.OP], rec[R.SEQ]
    head = f"{prefix(op)} {what or f'timed out after {rec[R.LIMIT]:g} s'}"
    if op in R.P2P_OPS:
        who = f"rank {rec[R.ROOT]}" if rec[R.ROOT] >= 0 else "any rank"
        detail = _shape_text(rec)
        head += (
            f"{' for' if what else ' waiting for'} {who} (point-to-point op #{seq} on group {g.group_name!r}"
            f"{', ' + detail[2:-1] if detail else ''})"
        )
        if answers is None:
            return head
        notes = [
            f"rank {p}: {answers[p].get('latest') or 'no op yet'}{_LEAVING * answers[p].get('leaving', False)}"
            if p in answers
            else f"rank {p}: did not answer"
            for p in peers
        ]
        return f"{head}; what the peer is doing: {'; '.join(notes)}"
    where = f"group {g.group_name!r} (ranks {list(g.ranks)}) at sequence number {seq}{_shape_text(rec)}"
    head += f" on {where}" if what else f", the timeout of {where}"
    if answers is None:
        return f"{head}; ranks that had not arrived: unknown (no other rank to ask)"
    missing, other, silent, notes = [], [], [], []
    for p in peers:
        info = answers.get(p)
        if info is None:
            silent.append(p)
        elif info.get("issued", 0) <= seq:
            missing.append(p)
            notes.append(
                f"rank {p} has issued {info.get('issued', 0)} collectives on this group; its latest "
                f"op: {info.get('latest') or 'none'}{_LEAVING * info.get('leaving', False)}"
            )
        elif info.get("at_seq") and info["at_seq"][0] != op:
            other.append(p)
            notes.append(f"rank {p} called {info['at_seq'][0]} at sequence number {seq}")
    text = f"{head}; ranks that had not arrived: {missing}"
    if other:
        text += f"; ranks that called another op at this sequence number: {other}"
    if silent:
        text += f"; ranks that did not answer the watchdog (dead, or stuck without releasing the GIL): {silent}"
    if notes:
        text += f" ({'; '.join(notes)})"
    return text


_LEAVING = ", leaving the job"
_atexit_registered = False


def _group_of(key: str) -> Optional[Any]:
    """The live group whose :func:`mpidist._core.recorder.group_key` is ``key``, or None."""
    return next((h for h in live_groups() if R.group_key(h) == key), None)


def start(st: Any) -> None:
    """Start the watchdog of ``st`` (the RuntimeState) and publish it as
    :data:`mpidist._core.current.watchdog`; it is stopped at exit at the latest."""
    global _atexit_registered
    _current.watchdog = _Watchdog(st)
    if not _atexit_registered:  # before mpi4py finalizes MPI (registered earlier, runs later)
        atexit.register(stop)
        _atexit_registered = True


def leaving() -> None:
    """This rank leaves the job (the final comparison of destroy_process_group() or exit): the
    running watchdog tells the peers that ask (:meth:`_Watchdog._stall`)."""
    if _current.watchdog is not None:
        _current.watchdog.leaving = True


def stop() -> None:
    """Stop the running watchdog, if any (its thread, signal handlers and communicator)."""
    wd, _current.watchdog = _current.watchdog, None
    if wd is not None:
        wd.stop()
