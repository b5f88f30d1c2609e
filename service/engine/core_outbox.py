"""The engine core's messages to its parent, written by a thread of their own (service/engine/core_process.py).

The step loop hands each step's outputs to the `Outbox` and goes on stepping; the sender thread turns them into
deltas (what each request added since its previous delta), pickles them and writes them to the pipe. So neither the
per-request work of a step's message nor a pipe that is full because the parent reads slowly holds up the next step:
while the sender waits on the pipe, later steps' outputs queue up and leave together, as one "out" message holding
every request's deltas in step order. Every message leaves in the order it was posted."""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from service.engine.output_stream import Delta, DeltaTracker
from service.engine.request import RequestOutput

JOIN_TIMEOUT_S = 10.0  # close() waits this long for the sender to write what is queued


@dataclass(frozen=True)
class _Outputs:
    outputs: list[RequestOutput]  # one step's outputs
    stats: dict[str, float] | None  # stats to send with them, if due


@dataclass(frozen=True)
class _Message:
    payload: bytes  # the pickled message
    forget: str | None  # request id whose delta bookkeeping ends with this message ("failed"), else None


class Outbox:
    """Ordered, coalescing sender of the engine core's messages (module docstring). `post_outputs` and `post` are
    called from the step loop's thread; everything else about the pipe's write side belongs to the sender thread."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._cond = threading.Condition()
        self._queue: list[_Outputs | _Message] = []  # posted, not yet written
        self._closed = False
        self._deltas = DeltaTracker()  # sender thread only
        self.error: OSError | None = None  # set when the pipe broke (the parent is gone); nothing is sent after
        self.send_seconds = 0.0  # sender thread's wall time making and writing messages (waits on a full pipe included)
        self.num_messages = 0  # messages written
        self._thread = threading.Thread(target=self._run, name="hybrid-serve-core-sender", daemon=True)
        self._thread.start()

    def post_outputs(self, outputs: list[RequestOutput], stats: dict[str, float] | None) -> None:
        """A step's outputs (RequestOutputs only ever read, never changed, after this) and maybe fresh stats."""
        if outputs or stats is not None:
            self._put(_Outputs(outputs, stats))

    def post(self, msg: tuple) -> None:
        """Any other message; pickled now, so it holds the values of this moment (a reply may hold live objects).
        A "failed" message also ends its request's delta bookkeeping."""
        forget = msg[1] if msg[0] == "failed" else None
        self._put(_Message(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), forget))

    def close(self) -> None:
        """Writes what is queued (up to JOIN_TIMEOUT_S) and ends the sender thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(JOIN_TIMEOUT_S)

    def _put(self, item: _Outputs | _Message) -> None:
        with self._cond:
            self._queue.append(item)
            if len(self._queue) == 1:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                items, self._queue = self._queue, []
            if not items:
                return
            t0 = time.perf_counter()
            try:
                self._write_all(items)
            except OSError as exc:  # the parent is gone; the step loop sees `error` and ends
                self.error = exc
                return
            self.send_seconds += time.perf_counter() - t0

    def _write_all(self, items: list[_Outputs | _Message]) -> None:
        """The queued items as messages: consecutive outputs merged into one "out" (deltas in step order, the
        newest stats), every other message as posted."""
        deltas: list[Delta] = []
        stats = None
        for item in items:
            if isinstance(item, _Outputs):
                deltas.extend(self._deltas.delta(out) for out in item.outputs)
                stats = item.stats if item.stats is not None else stats
                continue
            if deltas or stats is not None:
                self._write_out(deltas, stats)
                deltas, stats = [], None
            if item.forget is not None:
                self._deltas.forget(item.forget)
            self._write(item.payload)
        if deltas or stats is not None:
            self._write_out(deltas, stats)

    def _write_out(self, deltas: list[Delta], stats: dict[str, float] | None) -> None:
        self._write(pickle.dumps(("out", deltas, stats), protocol=pickle.HIGHEST_PROTOCOL))

    def _write(self, payload: bytes) -> None:
        self._conn.send_bytes(payload)
        self.num_messages += 1
