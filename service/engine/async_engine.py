"""AsyncEngine: the Engine on a background thread, an async stream per request, abort, drain.

The engine is single-threaded: every mutation (add, abort, step, introspection) runs on the engine
thread; callers talk to it through a command queue and get results through asyncio queues/futures.
If a step raises, every in-flight request gets the error and is aborted; the loop keeps serving."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.output_stream import DeltaTracker, OutputStream, wake_loops
from service.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("hybrid_serve.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig, model=None):
        self.engine = Engine(config, model)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.dtype = self.engine.dtype  # torch.dtype of weights and KV state
        self.config = config
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # request_id -> its accumulated output (engine thread writes)
        self._deltas = DeltaTracker()  # engine thread only
        self._stats = self.engine.stats()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="hybrid-serve-engine", daemon=True)
        self._thread.start()

    # ---------- public API ----------
    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        bypass_cache: bool = False,
        capture_states: bool = False,
        min_interval_s: Callable[[], float] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs; the last has finish_reason set. Raises ValueError on bad input.
        Each output holds everything before it, so only the newest is kept: a reader that falls behind, or that
        asks for `min_interval_s()` seconds between outputs (the first and the last come at once), is woken
        once per output it reads, not once per engine step.
        bypass_cache / capture_states: see `Engine.add_request` (used by the accuracy canary)."""
        if self._stopping:
            raise EngineDeadError("engine is shutting down")
        params = sampling_params or SamplingParams()
        ids = self.engine.validate_prompt(prompt)
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        stream = OutputStream(asyncio.get_running_loop(), rid, ids, None)  # the engine detokenises
        added: Future = Future()
        self._streams[rid] = stream
        self._submit(
            lambda: added.set_result(self.engine.add_request(ids, params, rid, bypass_cache, capture_states)), added
        )
        finished = False
        try:
            try:
                await asyncio.wrap_future(added)
            except BaseException:
                finished = True  # never added (or refused): there is nothing to abort
                raise
            while True:
                item = await stream.take(min_interval_s)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._submit(lambda: self._abort(rid))

    async def abort(self, request_id: str) -> None:
        done: Future = Future()
        self._submit(lambda: done.set_result(self._abort(request_id)), done)
        await asyncio.wrap_future(done)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def cached_prefix_hashes(self, max_blocks: int = 100_000) -> list[int]:
        return await self._call(lambda: self.engine.cached_prefix_hashes(max_blocks))

    async def pop_captured_states(self, request_id: str) -> dict:
        return await self._call(lambda: self.engine.pop_captured_states(request_id))

    async def check_integrity(self) -> None:
        await self._call(self.engine.check_integrity)

    async def inspect(self, fn: Callable[[Engine], T]) -> T:
        """`fn(engine)` on the engine thread between steps (introspection; `fn` must not change state)."""
        return await self._call(lambda: fn(self.engine))

    async def check_alive(self) -> None:
        """A round trip through the engine thread; raises if a rank process of the engine has died."""
        await self._call(self.engine.check_alive)

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stops accepting requests, lets running ones finish (up to drain_timeout_s), stops the loop."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._submit(self._abort_all)
        self._submit(lambda: setattr(self, "_running", False))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self.engine.shutdown()

    # ---------- engine thread ----------
    def _submit(self, fn: Callable[[], None], fut: Future | None = None) -> None:
        def guarded() -> None:
            try:
                fn()
            except BaseException as e:  # report to the caller; the loop lives on
                if fut is not None and not fut.done():
                    fut.set_exception(e)

        self._commands.put(guarded)
        self._wake.set()

    async def _call(self, fn: Callable):
        fut: Future = Future()
        self._submit(lambda: fut.set_result(fn()), fut)
        return await asyncio.wrap_future(fut)

    def _loop(self) -> None:
        self._running = True
        while self._running:
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_unfinished():
                self._stats = self.engine.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one failing step must not kill the replica
                log.exception("engine step failed; aborting in-flight requests")
                self._abort_all(e)
                continue
            self._deliver_all(outputs)
            self._stats = self.engine.stats()

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs into their streams: one wake-up per event loop, not one per request."""
        due: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
        for out in outputs:
            delta = self._deltas.delta(out)
            stream = self._streams.get(out.request_id)
            if stream is not None and stream.apply(delta):
                due.setdefault(stream.loop, []).append(stream)
        wake_loops(due)

    def _fail(self, rid: str, error: BaseException) -> None:
        self._deltas.forget(rid)
        stream = self._streams.get(rid)
        if stream is not None:
            stream.fail(error)
            wake_loops({stream.loop: [stream]})

    def _abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        if out is not None:
            self._deliver_all([out])

    def _abort_all(self, error: BaseException | None = None) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._fail(rid, error if error is not None else EngineDeadError("engine shut down"))
