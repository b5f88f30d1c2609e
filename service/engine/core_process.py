"""EngineProcess: the Engine's step loop in its own OS process (the engine core), driven over a pipe.

The process that creates an `EngineProcess` (a Serve replica, or any asyncio program) never builds the model
and never touches the device: a spawned child builds the `Engine` (and, for tp > 1, its rank processes) and
runs `step()` back to back, so the caller's event loop (streaming, detokenised chunks, metrics) and the step
loop no longer share one interpreter lock. The API is `AsyncEngine`'s: `generate` yields cumulative
`RequestOutput`s; `abort`, `stats`, `inspect`, `check_alive`, `shutdown` and the canary calls work the same.

Messages (pickled tuples on one duplex pipe; the child answers in order):
  parent -> child  ("add", [(request_id, prompt ids, SamplingParams, bypass_cache, capture_states), ...])
                                                              the requests added since the last message, in order
                   ("abort", request_id)                      fire and forget (a stream closed early)
                   ("call", seq, name, args)                  answered by ("reply", seq, ok, value)
                   ("stop",)
  child -> parent  ("ready", CoreInfo)
                   ("out", [Delta, ...], stats | None)        every request's new tokens of one engine step (of
                                                              several, in step order, when the parent reads slowly)
                   ("refused", request_id, ValueError)        add_request refused the request
                   ("failed", request_id, message)            a step failed; the request was aborted
                   ("stats", stats)                           after commands handled while idle
                   ("reply", seq, ok, value)
Text: the child detokenises only requests with stop strings (it must see the text to stop them); for the others
the parent detokenises each output's new ids when the reader takes it (one decode per output, not per token), so
the step loop does not pay for text it does not need.

Lifetime: `shutdown()` drains, stops the child and joins it; the child exits when its parent is gone (it watches
the parent's pid) and ends its rank processes the same way. A child that dies fails every open stream and
every pending call with `EngineDeadError`, and `check_alive` raises from then on.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from service.engine.async_engine import EngineDeadError
from service.engine.config import EngineConfig, ModelConfig
from service.engine.output_stream import OutputStream, wake_loops
from service.engine.request import RequestOutput, SamplingParams
from service.engine.tokenizer import IncrementalDetokenizer, Tokenizer, as_token_ids

log = logging.getLogger("hybrid_serve.engine")

START_TIMEOUT_S = 900.0  # the child must build its engine (and rank processes) within this
STOP_TIMEOUT_S = 15.0  # shutdown waits this long for the child before killing it
PARENT_POLL_S = 0.5  # how often the child checks that its parent is alive
IDLE_POLL_S = 0.5  # the idle child's longest wait for a command
STATS_INTERVAL_S = 0.02  # a busy child attaches its stats to a step's message at most this often


@dataclass(frozen=True)
class CoreInfo:
    """What the child reports once its engine is built."""

    pid: int  # the engine core process
    dtype: Any  # torch.dtype of weights and KV state
    max_model_len: int  # tokens
    vocab_size: int
    stats: dict[str, float]  # Engine.stats() at start


class EngineProcess:
    """An async engine whose `Engine` runs in a spawned child process (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_model_path(config.model_path)
        has_tok = os.path.exists(os.path.join(config.model_path, "tokenizer.json"))
        self.tokenizer = Tokenizer.from_model_path(config.model_path) if has_tok else None
        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe(duplex=True)
        # not a daemon: the child starts the rank processes (tp > 1), which a daemonic process may not
        self._proc = ctx.Process(
            target=_core_main, name="hybrid-serve-engine-core", args=(config, child_end, os.getpid())
        )
        self._proc.start()
        child_end.close()
        self._finalizer = weakref.finalize(self, _stop_child, self._proc, self._conn)  # also at interpreter exit
        self._send_lock = threading.Lock()
        self._streams: dict[str, OutputStream] = {}  # request_id -> its accumulated output (reader thread writes)
        self._calls: dict[int, Future] = {}  # seq -> caller waiting for the child's reply
        self._adds: list[tuple] = []  # requests not yet sent to the child (under _send_lock); see _queue_add
        self._seq = 0
        self._dead: str | None = None  # why the child is unusable
        self._stopping = False
        self.info = self._wait_ready()
        self.dtype = self.info.dtype
        self._stats = dict(self.info.stats)
        self._reader = threading.Thread(target=self._read_forever, name="hybrid-serve-core-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The engine core process' pid."""
        return self.info.pid

    # ---------- public API (AsyncEngine's) ----------
    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        bypass_cache: bool = False,
        capture_states: bool = False,
        min_interval_s: Callable[[], float] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs, the newest only (see `AsyncEngine.generate`); the last has
        finish_reason set. Raises ValueError on bad input, EngineDeadError if the child is gone."""
        if self._stopping or self._dead:
            raise EngineDeadError(self._dead or "engine is shutting down")
        params = sampling_params or SamplingParams()
        ids = self._encode(prompt)
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        detok = None
        if self.tokenizer is not None and not params.stop:  # the child leaves this request's text to us
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        stream = OutputStream(asyncio.get_running_loop(), rid, ids, detok)
        self._streams[rid] = stream
        finished = False
        try:
            self._queue_add((rid, ids, params, bypass_cache, capture_states))
            while True:
                item = await stream.take(min_interval_s)
                if isinstance(item, BaseException):
                    finished = isinstance(item, ValueError)  # refused: nothing to abort
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and not self._dead:
                self._send(("abort", rid))

    async def abort(self, request_id: str) -> None:
        """Aborts the request in the child (its stream ends with finish_reason "abort"); a no-op once the child
        is gone (so is the request)."""
        if not self._dead:
            await self._call("abort", request_id)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def cached_prefix_hashes(self, max_blocks: int = 100_000) -> list[int]:
        return await self._call("cached_prefix_hashes", max_blocks)

    async def pop_captured_states(self, request_id: str) -> dict:
        return await self._call("pop_captured_states", request_id)

    async def check_integrity(self) -> None:
        await self._call("check_integrity")

    async def inspect(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` in the child between steps; `fn` must be picklable (a module-level function)."""
        return await self._call("inspect", fn)

    async def check_alive(self) -> None:
        """A round trip through the child's step loop; raises if the child or one of its ranks has died."""
        await self._call("check_alive")

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stops accepting requests, lets running ones finish (up to drain_timeout_s), stops the child."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and not self._dead and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stops the child now (open streams get EngineDeadError); waits up to STOP_TIMEOUT_S, then kills it."""
        self._stopping = True
        with self._send_lock:
            self._finalizer()
        self._reader.join(5.0)

    # ---------- parent side ----------
    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return as_token_ids(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt is text but the model folder has no tokenizer.json; pass token ids")
        return self.tokenizer.encode(prompt)

    def _queue_add(self, add: tuple) -> None:
        """Queues one request for the child; the requests queued during one pass of the event loop leave in one
        message (a burst of arrivals costs one pickle, one pipe write and one read in the child, not one each)."""
        with self._send_lock:
            if self._dead:
                raise EngineDeadError(self._dead)
            self._adds.append(add)
            first = len(self._adds) == 1
        if first:
            asyncio.get_running_loop().call_soon(self._flush_adds)

    def _flush_adds(self) -> None:
        try:
            self._send(None)
        except EngineDeadError:  # the reader thread fails the queued requests' streams
            pass
        except Exception as exc:  # noqa: BLE001 - e.g. arguments that do not pickle: those requests fail, not the loop
            with self._send_lock:
                adds, self._adds = self._adds, []
            due: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
            for add in adds:
                if (stream := self._streams.get(add[0])) is not None:
                    stream.fail(exc)
                    due.setdefault(stream.loop, []).append(stream)
            wake_loops(due)

    def _send(self, msg: tuple | None) -> None:
        """Sends the queued adds (first: every later message, an abort of one of them too, follows them), then
        `msg` if not None."""
        payload = None if msg is None else pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._dead:
                raise EngineDeadError(self._dead)
            try:
                if self._adds:
                    self._conn.send_bytes(pickle.dumps(("add", self._adds), protocol=pickle.HIGHEST_PROTOCOL))
                    self._adds = []
                if payload is not None:
                    self._conn.send_bytes(payload)
            except OSError as exc:  # the child is gone; the reader thread is about to notice
                raise EngineDeadError(f"engine core process is unreachable: {exc}") from exc

    async def _call(self, name: str, *args: Any) -> Any:
        fut: Future = Future()
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            self._calls[seq] = fut
        try:
            self._send(("call", seq, name, args))
        except BaseException:  # dead child, or arguments that do not pickle
            self._calls.pop(seq, None)
            raise
        return await asyncio.wrap_future(fut)

    def _wait_ready(self) -> CoreInfo:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._conn.poll(1.0):
                try:
                    kind, *rest = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    self._proc.join(10.0)
                    raise RuntimeError(
                        f"engine core process exited during start (exit code {self._proc.exitcode}); its stderr says why"
                    ) from None
                if kind == "ready":
                    return rest[0]
                self._proc.join(10.0)
                raise RuntimeError(f"engine core process failed to start:\n{rest[0]}")
            if not self._proc.is_alive():
                raise RuntimeError(f"engine core process exited during start (exit code {self._proc.exitcode})")
        self._proc.kill()
        raise RuntimeError(f"engine core process did not start within {START_TIMEOUT_S:.0f} s")

    def _read_forever(self) -> None:
        """Reader thread: applies the child's messages to the streams; wakes each event loop once per message."""
        while True:
            try:
                msg = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            due: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
            try:
                self._handle(msg, due)
            except Exception:  # noqa: BLE001 - the reader must outlive a bad message, or every stream would hang
                log.exception("engine core message %r could not be handled", msg[0])
            wake_loops(due)
        self._proc.join(5.0)
        code = self._proc.exitcode
        why = "the engine was shut down" if self._stopping else f"engine core process exited (exit code {code})"
        self._on_dead(why)

    def _handle(self, msg: tuple, due: dict[asyncio.AbstractEventLoop, list[OutputStream]]) -> None:
        kind = msg[0]
        if kind == "out":
            for delta in msg[1]:
                stream = self._streams.get(delta[0])
                if stream is not None and stream.apply(delta):
                    due.setdefault(stream.loop, []).append(stream)
            if msg[2] is not None:
                self._stats = msg[2]
        elif kind == "stats":
            self._stats = msg[1]
        elif kind in ("refused", "failed"):
            stream = self._streams.get(msg[1])
            if stream is not None:
                err = msg[2] if kind == "refused" else RuntimeError(f"engine step failed: {msg[2]}")
                stream.fail(err)
                due.setdefault(stream.loop, []).append(stream)
        elif kind == "reply":
            _, seq, ok, value = msg
            fut = self._calls.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
        elif kind == "fatal":
            log.error("engine core process failed:\n%s", msg[1])

    def _on_dead(self, why: str) -> None:
        with self._send_lock:
            self._dead = why
        if not self._stopping:
            log.error("%s; failing %d open streams", why, len(self._streams))
        err = EngineDeadError(why)
        for seq in list(self._calls):
            fut = self._calls.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_exception(err)
        due: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
        for stream in list(self._streams.values()):
            stream.fail(err)
            due.setdefault(stream.loop, []).append(stream)
        wake_loops(due)


def _stop_child(proc: mp.process.BaseProcess, conn: Connection) -> None:
    """Asks the child to stop; kills it if it has not exited after STOP_TIMEOUT_S."""
    try:
        conn.send_bytes(pickle.dumps(("stop",)))
    except OSError:
        pass
    proc.join(STOP_TIMEOUT_S)
    if proc.is_alive():
        log.warning("engine core process %d did not stop within %.0f s: killing it", proc.pid, STOP_TIMEOUT_S)
        proc.kill()
        proc.join(5.0)


# ---------------------------------------------------------------- engine core process side
def _core_main(config: EngineConfig, conn: Connection, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        from service.engine.core_loop import CoreLoop  # the child alone imports the engine and torch's device side

        CoreLoop(config, conn).run()
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:  # noqa: BLE001 - the parent gets the traceback, then this process exits
        try:
            conn.send_bytes(pickle.dumps(("fatal", traceback.format_exc())))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    """Ends the engine core when its parent is gone (nobody would read its outputs)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(3)
