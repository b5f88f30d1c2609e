"""The engine deployment: one Ray Serve replica driving one `EngineProcess` (docs/design.md: Serving).

The replica streams, keeps metrics and runs the canary; the engine steps in its own child process (the engine
core), so the two never share an interpreter lock. The replica never touches the device.

The ingress calls `generate(prompt_token_ids, sampling_params, request_id)` through a streaming
DeploymentHandle; the prefix-aware router reads `prompt_token_ids` (the first argument) to route.
Each streamed item is a `GenerateChunk` holding only what is new since the previous one. Bad
prompts come back as one chunk with `error` set (never an exception that would look like a replica
failure). Cancelling the call (client disconnect) aborts the request in the engine.
`generate_group(GenerateGroup)` runs several requests in one call (service/deployments/groups.py), each exactly
as `generate` would, their chunks multiplexed by request id; `abort_requests(ids)` aborts single members.

Serve hooks: `record_replica_metadata` publishes the snapshot grid (the router's block size),
`record_routing_stats` the prefix hashes the cache can resume from (the router's index
correction), `check_health` fails when the engine core process (or one of its rank processes) is gone or does not
answer, `__del__` drains and shuts the engine down after Serve has waited for in-flight requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from service.deployments.args import QUEUED_REQUESTS_PER_REPLICA, AppArgs
from service.deployments.groups import GenerateGroup, GroupHeader, GroupMember
from service.deployments.metrics import CanaryMetrics, EngineMetrics
from service.deployments.placement import expose_rank_gpus
from service.deployments.pool_audit import audit_pools, resident_memory_bytes
from service.engine import SamplingParams
from service.engine.canary import CanaryCheck, audit_hit, pinned_canary, pinned_prompts
from service.engine.core_process import EngineProcess
from service.evals.canary_set import PinnedQuestion, is_correct, pinned_questions

logger = logging.getLogger("ray.serve")

STATS_INTERVAL_S = 1.0  # how often engine.stats() is exported to the metrics
ROUTING_REPORT_MAX_BLOCKS = 4096  # cached prefix hashes sent per routing-stats report
HEALTH_TIMEOUT_S = 10.0  # the engine core process must answer a health probe within this
MAX_STREAM_INTERVAL_S = 0.25  # a running stream sends its new tokens at least this often
OVERLOADED = "overloaded"  # GenerateChunk.error_code of a grouped request refused for want of room (HTTP 503)
OVERLOADED_MESSAGE = "The server is overloaded; retry later."  # what the client reads with any 503 "overloaded"
REMEMBERED_ABORTS = 4096  # aborted request ids kept in case their group call arrives after the abort


@dataclass(frozen=True)
class GenerateChunk:
    """What one request produced since the previous chunk (engine replica -> ingress)."""

    request_id: str
    token_ids: tuple[int, ...]  # newly generated token ids
    text: str  # newly detokenised text (stop strings removed)
    logprobs: tuple[float, ...] | None  # chosen-token logprob per new id, if asked
    top_logprobs: tuple[dict[int, float], ...] | None  # per new id: token id -> logprob, if asked
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    num_prompt_tokens: int  # prompt length in tokens
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    error: str | None = None  # set (alone) when the engine refused the request
    error_code: str | None = None  # with error: OVERLOADED when the replica had no room for it, else None (bad input)


def _delta_chunk(out: Any, sent_tokens: int, sent_text: str, num_prompt_tokens: int) -> GenerateChunk:
    """The part of a cumulative RequestOutput beyond what was already sent."""
    new_text = out.text[len(sent_text) :] if out.text.startswith(sent_text) else ""
    token_ids, logprobs, top_logprobs = out.tokens_since(sent_tokens)
    return GenerateChunk(
        request_id=out.request_id,
        token_ids=token_ids,
        text=new_text,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        finish_reason=out.finish_reason,
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )


class EngineDeployment:
    """Serve deployment class; `app.build_app` wraps it with `serve.deployment` options."""

    def __init__(self, app_args: dict[str, Any]):
        self._args = AppArgs.model_validate(app_args)
        config = self._args.engine_config()
        if config.tp > 1 and config.resolved().device.startswith("cuda"):  # before a rank process starts
            logger.info("tp=%d: rank GPUs %s", config.tp, expose_rank_gpus(config.tp))
        self._engine = EngineProcess(config)  # the engine steps in its own process; this one streams
        self._metrics = EngineMetrics()
        self._canary_metrics = CanaryMetrics()
        self._report_seq = 0
        self._open_streams = 0  # generate() calls in progress
        self._members: dict[str, asyncio.Task] = {}  # request id -> the task running it, for grouped requests
        self._aborted: OrderedDict[str, bool] = OrderedDict()  # ids aborted before their group call arrived
        self._group_calls = 0  # generate_group calls received
        self._group_requests = 0  # requests they carried (and this replica ran)
        # grouped requests follow Serve's bounds for calls: max_ongoing_requests run, (1 + queued) x that are open
        self._member_slots = asyncio.Semaphore(self._args.max_ongoing_requests)
        self._max_grouped = (1 + QUEUED_REQUESTS_PER_REPLICA) * self._args.max_ongoing_requests
        self._stats_task: asyncio.Task | None = None
        self._canary_task: asyncio.Task | None = None
        self._audits: set[asyncio.Task] = set()  # in-flight audits of sampled real hits
        stats = self._engine.stats()
        self._grid_tokens = int(stats["snapshot_grid_tokens"])
        self._max_model_len = int(stats["max_model_len"])
        self._ensure_stats_loop()

    # ---- requests ----
    async def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the request's progress as `GenerateChunk`s; the last has `finish_reason` set."""
        self._ensure_stats_loop()
        request_id = request_id or uuid.uuid4().hex
        start = last = time.perf_counter()
        ttft: float | None = None
        gaps: list[float] = []
        sent_tokens, sent_text, finished = 0, "", False
        audit = self._caching and random.random() < self._args.canary.audit_sample_rate
        self._open_streams += 1
        try:
            async for out in self._engine.generate(
                list(prompt_token_ids),
                sampling_params,
                request_id=request_id,
                capture_states=audit,
                min_interval_s=self._stream_interval_s,
            ):
                chunk = _delta_chunk(out, sent_tokens, sent_text, len(prompt_token_ids))
                now = time.perf_counter()
                if chunk.token_ids:
                    if ttft is None:
                        ttft = now - start
                    else:  # one observation per chunk: its gap shared by its tokens
                        gaps.append((now - last) / len(chunk.token_ids))
                    last = now
                sent_tokens, sent_text = out.num_output_tokens, sent_text + chunk.text
                finished = out.finish_reason is not None
                yield chunk
        except ValueError as exc:  # refused before any output: empty or too-long prompt, bad ids
            finished = True
            yield GenerateChunk(request_id, (), "", None, None, None, len(prompt_token_ids), 0, error=str(exc))
        finally:
            self._open_streams -= 1
            if not finished:  # cancelled (client went away) or failed mid-stream
                await asyncio.shield(self._engine.abort(request_id))
            self._metrics.observe_request(ttft, gaps, time.perf_counter() - start)
            if audit:
                self._start_audit(request_id, list(prompt_token_ids))

    async def generate_group(self, group: GenerateGroup) -> AsyncIterator[GroupHeader | tuple[GenerateChunk, ...]]:
        """Run several requests in one call (service/deployments/groups.py): first a `GroupHeader` naming the
        members this replica runs, then tuples of their `GenerateChunk`s, each tuple what the members produced
        since the previous one (every member's chunks as `generate` streams them). Ends when every member has."""
        chunks: asyncio.Queue[GenerateChunk | None] = asyncio.Queue()  # None: a member ended
        tasks, accepted, refused = [], [], 0
        for m in group.members:
            if self._aborted.pop(m.request_id, False):  # aborted before its call arrived
                continue
            accepted.append(m.request_id)
            if len(self._members) < self._max_grouped:
                tasks.append(self._start_member(m, chunks))
            else:  # as many as Serve would run or queue for this replica are open: 503, as its queue bound gives
                refused += 1
                chunks.put_nowait(
                    GenerateChunk(m.request_id, (), "", None, None, None, len(m.prompt_token_ids), 0,
                                  error=OVERLOADED_MESSAGE, error_code=OVERLOADED)
                )  # fmt: skip
        self._group_calls += 1
        self._group_requests += len(tasks)
        self._metrics.record_group(len(tasks))
        try:
            yield GroupHeader(serve.get_replica_context().replica_id.unique_id, tuple(accepted))
            running = len(tasks) + refused  # a refusal is one chunk, ending its member
            while running:
                batch = [await chunks.get()]
                while not chunks.empty():
                    batch.append(chunks.get_nowait())
                running -= sum(c is None or c.error_code == OVERLOADED for c in batch)
                out = tuple(c for c in batch if c is not None)
                if out:
                    yield out
        finally:  # the ingress went away: every member still running is aborted by its own generate()
            for task in tasks:
                task.cancel()

    def _start_member(self, member: GroupMember, chunks: asyncio.Queue) -> asyncio.Task:
        """One member of a group as a task: once one of the max_ongoing_requests slots is free, its `generate`
        stream into the group's queue; then None (also when it is cancelled before it starts)."""

        async def pump() -> None:
            async with self._member_slots:
                async for chunk in self.generate(member.prompt_token_ids, member.sampling_params, member.request_id):
                    chunks.put_nowait(chunk)

        def ended(_: asyncio.Task) -> None:
            self._members.pop(member.request_id, None)
            chunks.put_nowait(None)

        task = asyncio.get_running_loop().create_task(pump())
        task.add_done_callback(ended)
        self._members[member.request_id] = task
        return task

    async def abort_requests(self, request_ids: list[str]) -> int:
        """Abort these grouped requests if this replica runs them (the ingress broadcasts a client's disconnect to
        every replica); an id not started yet is remembered, so its group call skips it. Returns how many ran here."""
        found = 0
        for rid in request_ids:
            task = self._members.get(rid)
            if task is not None:
                task.cancel()  # its generate() aborts the request in the engine
                found += 1
            else:
                self._aborted[rid] = True
                while len(self._aborted) > REMEMBERED_ABORTS:
                    self._aborted.popitem(last=False)
        return found

    def _stream_interval_s(self) -> float:
        """Seconds between a stream's chunks: the replica's chunk rate stays near `stream_chunks_per_s` however
        many streams are open (each chunk costs the same in every process it crosses, whatever it holds)."""
        return min(MAX_STREAM_INTERVAL_S, self._open_streams / self._args.stream_chunks_per_s)

    async def info(self) -> dict[str, Any]:
        """Static facts the ingress needs (max_model_len, snapshot grid)."""
        return {"max_model_len": self._max_model_len, "snapshot_grid_tokens": self._grid_tokens}

    async def stats(self, audit: bool = False) -> dict[str, Any]:
        """The engine's counters and gauges (as of its last step), plus this replica's id, actor name, resident
        memory and the pids of the replica and its engine core process; with `audit`, also who holds the pools and check_integrity's verdict (`pool_audit`)."""
        replica = serve.get_replica_context().replica_id
        out = {
            **self._engine.stats(),
            "replica_id": replica.unique_id,
            "replica_actor_name": replica.to_full_id_str(),
            "rss_bytes": resident_memory_bytes(),
            "replica_pid": os.getpid(),
            "engine_core_pid": self._engine.pid,
            "group_calls": self._group_calls,
            "group_requests": self._group_requests,
        }
        if audit:
            out["pool_audit"] = await self._engine.inspect(audit_pools)
        return out

    # ---- Serve hooks ----
    async def record_replica_metadata(self) -> dict[str, Any]:
        return {"snapshot_grid_tokens": self._grid_tokens, "max_model_len": self._max_model_len}

    async def record_routing_stats(self) -> dict[str, Any]:
        self._ensure_stats_loop()
        self._report_seq += 1
        stats = self._engine.stats()
        return {
            "report_seq": self._report_seq,
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "snapshot_grid_tokens": self._grid_tokens,
            "cached_prefix_hashes": list(await self._engine.cached_prefix_hashes(ROUTING_REPORT_MAX_BLOCKS)),
            "num_requests_running": stats["num_requests_running"],
            "num_requests_waiting": stats["num_requests_waiting"],
            "kv_cache_usage_ratio": stats["kv_cache_usage_ratio"],
        }

    async def check_health(self) -> None:
        """A round trip through the engine core's step loop: fails (or times out) if it is stuck or dead, or if a
        tensor-parallel rank process has died (Serve then replaces the replica)."""
        self._ensure_stats_loop()
        await asyncio.wait_for(self._engine.check_alive(), timeout=HEALTH_TIMEOUT_S)

    async def __del__(self) -> None:
        for task in (self._stats_task, self._canary_task, *self._audits):
            if task is not None:
                task.cancel()
        await self._engine.shutdown()

    # ---- accuracy canary ----
    @property
    def _caching(self) -> bool:
        return self._args.canary.enabled and self._args.mamba_cache_strategy != "off"

    def _record(self, check: CanaryCheck) -> None:
        self._canary_metrics.record(check.kind, check.mismatch, check.max_state_rel_error, check.token_agreement)
        if check.mismatch:
            logger.error("accuracy canary mismatch: %s", check)

    def _start_audit(self, request_id: str, prompt: list[int]) -> None:
        async def audit() -> None:
            captured = (await self._engine.pop_captured_states(request_id)).get("hit")
            if captured is not None:
                self._record(await audit_hit(self._engine, prompt, captured))

        task = asyncio.get_running_loop().create_task(audit())
        self._audits.add(task)
        task.add_done_callback(self._audits.discard)

    async def _canary_forever(self) -> None:
        """Every canary.interval_s: the pinned prompts, cached vs cold, on this replica. With a chat template they
        are the trained tasks' questions, and the share answered correctly is exported too."""
        questions = pinned_questions(self._engine.tokenizer) if self._engine.tokenizer else []
        prompts = [] if questions else pinned_prompts(self._engine.model_config.vocab_size, self._grid_tokens)
        while True:
            await asyncio.sleep(self._args.canary.interval_s)
            await self._canary_round(questions, prompts)

    async def _canary_round(self, questions: list[PinnedQuestion], prompts: list[list[int]]) -> None:
        correct = asked = 0
        for question in questions:
            try:
                check = await pinned_canary(self._engine, question.prompt_ids, question.max_tokens, ignore_eos=False)
            except Exception:  # a failed canary run is logged; health checks see real engine failures
                logger.exception("accuracy canary run failed")
                continue
            self._record(check)
            asked += 1
            correct += is_correct(question, check.text)
        self._canary_metrics.record_answers(correct, asked)
        for prompt in prompts:
            try:
                self._record(await pinned_canary(self._engine, prompt))
            except Exception:
                logger.exception("accuracy canary run failed")

    # ---- metrics export ----
    def _ensure_stats_loop(self) -> None:
        """Start the periodic stats export (and the canary) on the replica's event loop, once, from any async hook."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # constructed outside the event loop: the first async hook starts it
            return
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = loop.create_task(self._export_stats_forever())
        if self._caching and (self._canary_task is None or self._canary_task.done()):
            self._canary_task = loop.create_task(self._canary_forever())

    async def _export_stats_forever(self) -> None:
        while True:
            try:
                self._metrics.update_from_stats(self._engine.stats())
            except Exception:  # a failed export must not stop future ones; health checks see real failures
                logger.exception("exporting engine stats failed")
            await asyncio.sleep(STATS_INTERVAL_S)
