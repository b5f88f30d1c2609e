"""The ranks of one engine: the workers that carry out each `StepPlan` (DESIGN §5, tensor parallelism).

`start_workers` returns `LocalWorkers` for tp == 1 (the runner in the engine's process, called directly: no
copy, no serialization) and `ProcessWorkers` for tp > 1: one spawned process per rank (rank r on `cuda:r` on
CUDA), a torch.distributed group over them (gloo on CPU, NCCL on CUDA, rendezvous on 127.0.0.1 with a free port),
and a pipe per rank. Every plan is pickled once and sent to every rank; rank 0 samples and sends the results back;
the other ranks send nothing for a step. Sampled tokens of a launched step reach the other ranks through the
group (`ModelRunner._share_tokens`), so a carried row has its input on every rank.

Lifetime: `shutdown()`, garbage collection of the group, or the engine process dying end the rank processes
(each watches its parent's pid and its pipe). A rank that dies makes the next call raise `RankFailedError`
naming it (the parent waits on the pipes and the process sentinels together, never on a collective).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from service.engine.cache.pools import PoolSizes
from service.engine.config import EngineConfig, ModelConfig
from service.engine.distributed.parallel import ParallelContext
from service.engine.distributed.step import SlotOps, StepPlan
from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.sampler import SamplerOutput

log = logging.getLogger("hybrid_serve.engine")

COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting this long for a peer fails (the parent notices dead ranks first)
START_TIMEOUT_S = 600.0  # rank processes must build their model within this
STOP_TIMEOUT_S = 5.0  # shutdown waits this long for each rank before killing it
PARENT_POLL_S = 0.5  # how often a rank checks that the engine process is alive
PEER_EXIT_GRACE_S = 1.0  # a rank's error waits this long for a peer's exit to show (a dead peer is the root cause)


class RankFailedError(RuntimeError):
    """A rank process died or failed; the engine cannot go on (restart it)."""


class LocalWorkers:
    """tp == 1: the rank-0 runner in this process."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pool_sizes: PoolSizes = runner.pool_sizes  # what the engine's allocators hand out
        self.memory_stats: dict[str, float] = runner.memory_plan.stats() if runner.memory_plan is not None else {}
        self.tp = 1

    def execute(self, plan: StepPlan) -> SamplerOutput:
        return self.runner.execute(plan)

    def launch(self, plan: StepPlan):
        """Enqueues the step; the returned handle's `result()` waits for its sampled tokens."""
        return self.runner.launch(plan)

    def apply(self, ops: SlotOps) -> None:
        self.runner.apply(ops)

    def read_slot(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per rank: copies of one mamba slot's (conv [L_m, conv_dim, K-1], ssm [L_m, H, P, N])."""
        return [self.runner.pools.read_slot(slot)]

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def start_workers(cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int, model=None):
    """The ranks of an engine: in-process for tp == 1 (a prebuilt model allowed), spawned processes otherwise."""
    if cfg.tp == 1:
        return LocalWorkers(ModelRunner(cfg, model_cfg, max_model_len, model))
    if model is not None:
        raise ValueError(f"a prebuilt model runs with tp=1 only (got tp={cfg.tp}); let each rank build its own")
    return ProcessWorkers(cfg, model_cfg, max_model_len)


class _Pending:
    """A launched step's results, read from rank 0 when asked."""

    def __init__(self, group: ProcessWorkers, seq: int):
        self.group, self.seq = group, seq

    def result(self) -> SamplerOutput:
        return self.group._reply(self.seq)


class ProcessWorkers:
    """tp > 1: one spawned process per rank (see the module docstring)."""

    runner = None  # no rank runs in the engine's process

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int):
        self.tp = cfg.tp
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(cfg.tp):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_rank_main,
                name=f"hybrid-serve-rank{rank}",
                daemon=True,
                args=(rank, port, cfg, model_cfg, max_model_len, child_end, os.getpid()),
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_ranks, list(self.procs), list(self.conns))
        self._seq = 0  # id of the last message that expects a reply
        self._replies: dict[int, Any] = {}  # seq -> reply read from rank 0 ahead of its turn
        self._failed: str | None = None  # why the group is unusable
        ready = [self._read(rank, time.monotonic() + START_TIMEOUT_S)[1] for rank in range(self.tp)]
        # every rank's tensors hold at least these ids (ranks may plan their memory apart)
        self.pool_sizes = PoolSizes(
            *(min(getattr(r[0], f) for r in ready) for f in ("num_kv_pages", "num_live_slots", "num_snapshot_slots"))
        )
        self.memory_stats: dict[str, float] = ready[0][1]  # rank 0's memory plan (memory_plan_* keys)
        log.info("tensor parallelism: %d rank processes %s ready", self.tp, [p.pid for p in self.procs])

    # ---------- engine-facing calls ----------
    def execute(self, plan: StepPlan) -> SamplerOutput:
        return self._reply(self._send_all(("execute", plan)))

    def launch(self, plan: StepPlan) -> _Pending:
        return _Pending(self, self._send_all(("launch", plan)))

    def apply(self, ops: SlotOps) -> None:
        """Sends the between-steps work; a no-op once the group has failed (aborting requests of a dead engine
        must still work: the next step or check_alive reports the failure)."""
        try:
            self._send_all(("apply", ops), reply=False)
        except RankFailedError:
            log.warning("dropping slot work for the failed rank group: %s", self._failed)

    def read_slot(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seq = self._send_all(("read_slot", slot))
        return [self._reply(seq, rank) for rank in range(self.tp)]

    def check_alive(self) -> None:
        """Raises RankFailedError if a rank process has exited (or the group failed before)."""
        if self._failed is None:
            dead = [(r, p) for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                self._fail(", ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in dead))
        if self._failed is not None:
            raise RankFailedError(self._failed)

    def shutdown(self) -> None:
        self._failed = self._failed or "the engine was shut down"
        self._finalizer()

    # ---------- messages ----------
    def _send_all(self, msg: tuple, reply: bool = True) -> int:
        """Sends msg (pickled once) to every rank; returns its seq (replies carry it)."""
        self.check_alive()
        if reply:
            self._seq += 1
        payload = pickle.dumps((self._seq if reply else 0, *msg), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                self._fail(f"rank {rank} (pid {self.procs[rank].pid}) is unreachable: {e}")
                raise RankFailedError(self._failed) from e
        return self._seq

    def _reply(self, seq: int, rank: int = 0) -> Any:
        """The reply of `rank` to message seq (replies arrive in order; earlier ones are kept for their callers)."""
        key = (rank, seq)
        while key not in self._replies:
            got_seq, value = self._read(rank, None)
            self._replies[(rank, got_seq)] = value
        return self._replies.pop(key)

    def _read(self, rank: int, deadline: float | None) -> tuple[int, Any]:
        """The next message from `rank`, waiting on its pipe and on every rank's process sentinel."""
        conn = self.conns[rank]
        sentinels = [p.sentinel for p in self.procs]
        while True:
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"rank {rank} did not answer within {START_TIMEOUT_S:.0f} s")
                raise RankFailedError(self._failed)
            ready = wait([conn, *sentinels], timeout=1.0)
            if conn in ready:
                try:
                    kind, seq, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    continue  # the rank is gone: its sentinel is ready, check_alive says so
                if kind == "error":
                    self._fail(self._error_cause(rank, value))
                    raise RankFailedError(self._failed)
                return seq, value

    def _error_cause(self, rank: int, trace: str) -> str:
        """The failure a rank's error reports, led by any peer that has exited: a peer's death reaches the survivors
        as a collective error (a reset connection) that can arrive before the peer's exit is visible here."""
        deadline = time.monotonic() + PEER_EXIT_GRACE_S
        dead = []
        for r, proc in enumerate(self.procs):
            if r != rank:
                proc.join(max(0.0, deadline - time.monotonic()))
                if not proc.is_alive():
                    dead.append(f"rank {r} (pid {proc.pid}) exited with code {proc.exitcode}")
        if not dead:
            return f"rank {rank} failed:\n{trace}"
        return f"{', '.join(dead)}; then rank {rank} failed:\n{trace}"

    def _fail(self, why: str) -> None:
        """Marks the group unusable and ends every rank (the living ones may wait in a collective forever)."""
        if self._failed is None:
            self._failed = f"tensor-parallel engine is down: {why}"
            log.error(self._failed)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self._finalizer()


def _stop_ranks(procs: list, conns: list[Connection]) -> None:
    """Asks every rank to stop, then kills the ones that have not exited after STOP_TIMEOUT_S."""
    stop = pickle.dumps((0, "stop", None))
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- rank process side
def _watch_parent(parent_pid: int) -> None:
    """Ends this rank when the engine process is gone (it may be blocked in a collective, deaf to its pipe)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(3)


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """The config a rank builds with: rank r on CUDA device (base + r) when the engine runs on CUDA."""
    if not cfg.device.startswith("cuda"):
        return cfg
    base = int(cfg.device.split(":")[1]) if ":" in cfg.device else 0
    return dataclasses.replace(cfg, device=f"cuda:{base + rank}")


def _rank_main(
    rank: int,
    port: int,
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    max_model_len: int,
    conn: Connection,
    parent_pid: int,
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        cfg = rank_config(cfg, rank)
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.device))
        else:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tp))
        torch.distributed.init_process_group(
            "nccl" if cfg.device.startswith("cuda") else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=cfg.tp,
            rank=rank,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        parallel = ParallelContext(cfg.tp, cfg.ep, rank, torch.distributed.group.WORLD)
        runner = ModelRunner(cfg, model_cfg, max_model_len, parallel=parallel)
        plan = runner.memory_plan.stats() if runner.memory_plan is not None else {}
        _send(conn, "ready", 0, (runner.pool_sizes, plan))
        _serve(runner, conn)
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:  # noqa: BLE001 - the parent gets the traceback, then this rank exits
        try:
            _send(conn, "error", 0, traceback.format_exc())
        except OSError:
            pass
        os._exit(1)
    os._exit(0)  # no interpreter teardown: a collective peer may already be gone


def _send(conn: Connection, kind: str, seq: int, value: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, seq, value), protocol=pickle.HIGHEST_PROTOCOL))


def _serve(runner: ModelRunner, conn: Connection) -> None:
    """The rank's loop. A launched step's results are sent after the next message (if one is already waiting)
    has been started, so rank 0 keeps the device busy while the engine reads them."""
    pending: tuple[int, Any] | None = None  # (seq, InFlightStep) launched, results not sent yet (rank 0)
    while True:
        if pending is not None and not conn.poll():
            _send(conn, "result", pending[0], pending[1].result())
            pending = None
        seq, kind, value = pickle.loads(conn.recv_bytes())
        if kind == "stop":
            return
        if kind == "launch":
            step = runner.launch(value)
            if pending is not None:
                _send(conn, "result", pending[0], pending[1].result())
            pending = (seq, step) if runner.rank == 0 else None
            continue
        if pending is not None:
            _send(conn, "result", pending[0], pending[1].result())
            pending = None
        if kind == "execute":
            out = runner.execute(value)
            if runner.rank == 0:
                _send(conn, "result", seq, out)
        elif kind == "apply":
            runner.apply(value)
        elif kind == "read_slot":
            conv, ssm = runner.pools.read_slot(value)
            _send(conn, "state", seq, (conv.cpu(), ssm.cpu()))
        else:
            raise ValueError(f"unknown message {kind!r}")
