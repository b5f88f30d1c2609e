"""The engine core process' loop: commands from the pipe between steps, each step's outputs to the outbox.

Runs in the child that `EngineProcess` spawns (the message formats are in service/engine/core_process.py).
The loop owns the `Engine`: it builds it, drains pending commands, steps while there is work, and hands every
step's outputs to the `Outbox` (service/engine/core_outbox.py), whose thread sends every request's new tokens,
text, logprobs and finish reason in one pickled message per step (or per few steps, when the parent reads slowly).
Its stats add where the loop's time went (`core_stats`)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from service.engine.config import EngineConfig
from service.engine.core_outbox import Outbox
from service.engine.core_process import IDLE_POLL_S, STATS_INTERVAL_S, CoreInfo
from service.engine.engine import Engine
from service.engine.request import CapturedState

if TYPE_CHECKING:
    from service.engine.kernels.compile_watch import CompileWatch

log = logging.getLogger("hybrid_serve.engine")

SLOW_STEP_S = 0.25  # an engine step slower than this is logged with what it held and how long the collector ran


class GcClock:
    """Wall seconds this process spent in Python's garbage collector (gc.callbacks), cumulative."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


class CoreLoop:
    def __init__(self, config: EngineConfig, conn: Connection):
        self.conn = conn
        self.engine = Engine(config, detokenize=False)  # the parent detokenises requests without stop strings
        # what start-up made (the model's modules, the warm-up's garbage) leaves the collector's view: later
        # collections walk only what serving allocates
        gc.collect()
        gc.freeze()
        self.gc = GcClock()
        self.compiles = _compile_watch(self.engine.config)
        self.running = True
        self.stats_at = 0.0  # time.monotonic() of the last stats sent
        self.step_s = 0.0  # wall seconds in engine.step()
        self.idle_s = 0.0  # wall seconds waiting for a command with no request to step
        self.num_steps = 0  # engine.step() calls
        self.outbox = Outbox(conn)  # every message leaves through it, in order
        e = self.engine
        self._send(
            ("ready", CoreInfo(os.getpid(), e.dtype, e.max_model_len, e.model_config.vocab_size, self.core_stats()))
        )

    def run(self) -> None:
        try:
            self._loop()
            self._fail_all("the engine was shut down")
            self.engine.shutdown()
        finally:
            self.outbox.close()

    def _loop(self) -> None:
        engine = self.engine
        while self.running:
            if self.outbox.error is not None:  # the parent is gone: nobody reads what this loop makes
                raise self.outbox.error
            busy = engine.has_unfinished()
            t0 = time.perf_counter()
            handled = self._drain(0.0 if busy else IDLE_POLL_S)
            if not engine.has_unfinished():
                self.idle_s += time.perf_counter() - t0
                if handled:
                    self._send(("stats", self.core_stats()))
                continue
            t0, gc0 = time.perf_counter(), self.gc.seconds
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - one failing step must not end the engine
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                continue
            finally:
                step_s = time.perf_counter() - t0
                self.step_s += step_s
                self.num_steps += 1
            compiled = self.compiles.take() if self.compiles is not None else []
            if step_s > SLOW_STEP_S:
                self._log_slow_step(step_s, self.gc.seconds - gc0, compiled)
            self.outbox.post_outputs(outputs, self._stats_if_due())

    def _log_slow_step(self, step_s: float, gc_s: float, compiled: list[str]) -> None:
        sched = self.engine.scheduler
        log.warning(
            "engine step %d took %.0f ms (%.0f ms in the garbage collector; kernel variants loaded: %s); "
            "%d requests running, %d waiting",
            self.num_steps, 1e3 * step_s, 1e3 * gc_s, ", ".join(compiled) or "none", len(sched.running),
            len(sched.waiting),
        )  # fmt: skip

    # ---------- commands ----------
    def _drain(self, timeout_s: float) -> bool:
        """Handles every command already in the pipe (waiting up to timeout_s for the first); True if any."""
        handled = False
        while self.running and self.conn.poll(0.0 if handled else timeout_s):
            self._command(pickle.loads(self.conn.recv_bytes()))
            handled = True
        return handled

    def _command(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            for rid, ids, params, bypass_cache, capture_states in msg[1]:
                try:
                    self.engine.add_request(ids, params, rid, bypass_cache, capture_states)
                except ValueError as exc:
                    self._send(("refused", rid, ValueError(str(exc))))
        elif kind == "abort":
            self._abort(msg[1])
        elif kind == "call":
            _, seq, name, args = msg
            try:
                self._send(("reply", seq, True, self._call(name, args)))
            except Exception as exc:  # noqa: BLE001 - the caller gets the error; the loop lives on
                self._send(("reply", seq, False, _portable(exc)))
        elif kind == "stop":
            self.running = False
        else:
            raise ValueError(f"unknown engine core command {kind!r}")

    def _call(self, name: str, args: tuple) -> Any:
        engine = self.engine
        if name == "abort":
            return self._abort(*args)
        if name == "cached_prefix_hashes":
            return engine.cached_prefix_hashes(*args)
        if name == "pop_captured_states":
            return {k: _on_cpu(v) for k, v in engine.pop_captured_states(*args).items()}
        if name == "check_integrity":
            return engine.check_integrity()
        if name == "inspect":
            return args[0](engine)
        if name == "check_alive":
            return engine.check_alive()
        raise ValueError(f"unknown engine core call {name!r}")

    def _abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        if out is not None:
            self.outbox.post_outputs([out], self.core_stats())

    def _fail_all(self, why: str) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._send(("failed", rid, why))  # the outbox forgets the request's deltas

    # ---------- outputs ----------
    def core_stats(self) -> dict[str, float]:
        """`Engine.stats()` plus where this loop's time went (wall seconds, cumulative) and its step count. A step
        not launched ahead counts its whole execution as device wait."""
        wait = self.engine.step_seconds["execute"]  # in Engine.step, waiting for a step's results
        return {
            **self.engine.stats(),
            "core_host_seconds": self.step_s - wait,  # the rest of Engine.step: scheduling, launching, updating
            "core_device_wait_seconds": wait,
            "core_idle_seconds": self.idle_s,
            "core_send_seconds": self.outbox.send_seconds,
            "core_gc_seconds": self.gc.seconds,
            "core_steps": self.num_steps,
        }

    def _stats_if_due(self) -> dict[str, float] | None:
        now = time.monotonic()
        if now - self.stats_at < STATS_INTERVAL_S and self.engine.has_unfinished():
            return None
        self.stats_at = now
        return self.core_stats()

    def _send(self, msg: tuple) -> None:
        self.outbox.post(msg)


def _compile_watch(config: EngineConfig) -> CompileWatch | None:
    """With triton kernels (`config` resolved): a watch on the kernel variants loaded from now on (after the
    engine's warm-up)."""
    if config.kernel_backend != "triton":
        return None
    from service.engine.kernels.compile_watch import CompileWatch  # imports triton: only with triton kernels

    return CompileWatch()


def _on_cpu(state: CapturedState) -> CapturedState:
    """A captured state the parent can unpickle without touching the device."""
    return dataclasses.replace(state, conv=state.conv.cpu(), ssm=state.ssm.cpu())


def _portable(exc: Exception) -> Exception:
    """exc if it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable error is reported by name
        return RuntimeError(f"{type(exc).__name__}: {exc}")
