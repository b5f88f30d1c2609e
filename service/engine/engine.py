"""The synchronous engine: `step()` = schedule -> run -> update."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.cache.block_hash import chained_block_hashes
from service.engine.cache.manager import CacheManager
from service.engine.cache.pools import SlotPools
from service.engine.config import EngineConfig, ModelConfig
from service.engine.distributed.parallel import check_shardable
from service.engine.distributed.step import SlotOps
from service.engine.distributed.worker_group import start_workers
from service.engine.output import OutputProcessor
from service.engine.request import CapturedState, FinishReason, Request, RequestOutput, SamplingParams
from service.engine.runner.model_runner import ModelRunner, resolve_dtype, resolve_ssm_dtype
from service.engine.runner.sampler import SamplerOutput
from service.engine.scheduler.scheduler import Scheduler, SchedulerOutput
from service.engine.tokenizer import Tokenizer, as_token_ids
from service.engine.warmup import warm_up

MAX_CAPTURED_REQUESTS = 64  # state copies kept for capture_states requests until popped


@dataclass(frozen=True)
class InFlight:
    """A launched step whose results are not read yet (async scheduling)."""

    sched: SchedulerOutput  # what was launched (its plan went to every rank)
    pending: Any  # the ranks' handle: `result()` -> SamplerOutput, waits for this step only


class Engine:
    """Scheduler, cache manager and requests (ids only cross to the ranks); `workers` run each step's plan:
    in this process for tp == 1, one process per rank otherwise (`shutdown()` ends them).
    detokenize=False: outputs carry text only for requests with stop strings (the caller detokenises the rest)."""

    def __init__(self, config: EngineConfig, model=None, detokenize: bool = True):
        config = config.resolved()
        config.validate()
        self.config = config
        self.model_config = ModelConfig.from_model_path(config.model_path)
        check_shardable(self.model_config, config.tp, config.ep)  # before any rank process starts
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        has_tok = os.path.exists(os.path.join(config.model_path, "tokenizer.json"))
        self.tokenizer = Tokenizer.from_model_path(config.model_path) if has_tok else None
        self.workers = start_workers(config, self.model_config, self.max_model_len, model)
        # the rank-0 worker when it runs in this process (tp == 1), else None
        self.runner: ModelRunner | None = self.workers.runner
        self.dtype = resolve_dtype(config, self.model_config)  # weights and KV/conv state (ssm state is fp32)
        self._detokenize = detokenize
        self._reset()
        if config.warmup_steps:
            warm_up(self, config.warmup_steps)
            self._reset()  # the warm-up leaves no request, cache entry or count behind

    def _reset(self) -> None:
        """Fresh scheduling state: pools, prefix cache, scheduler, output processor and counters (the ranks'
        tensors are kept: no request holds a slot or page, and every slot and page is written before it is read)."""
        config = self.config
        pools = SlotPools(self.workers.pool_sizes, config.page_size)
        self.cache = CacheManager(
            pools,
            config.mamba_cache_strategy,
            config.page_size,
            self.model_config.chunk_size,
            config.mamba_track_interval,
        )
        self.scheduler = Scheduler(
            self.cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.async_scheduling,
            # rounded (bf16) SSM states: budget cuts of a prefill land on SSD chunk ends, where the scan rounds
            self.model_config.chunk_size if resolve_ssm_dtype(config, self.model_config) != torch.float32 else 0,
        )
        eos = self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_id
        self.output = OutputProcessor(self.tokenizer, tuple(eos), self.max_model_len, self._detokenize)
        self.requests: dict[str, Request] = {}  # request_id -> unfinished request
        self.captured: dict[str, dict[str, CapturedState]] = {}  # request_id -> "hit"|"prompt" -> state copy
        self._order = itertools.count()
        self._inflight: InFlight | None = None  # launched step whose results are not read yet (async)
        self._released: list[str] = []  # retired request ids the ranks have not been told of
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests
        self.num_generation_tokens = 0  # tokens sampled
        self.num_steps = 0  # steps that ran a forward
        self.num_steps_ahead = 0  # steps launched before the previous step's tokens were read
        self.num_prefill_steps_ahead = 0  # of those, steps holding a prefill chunk (a row of more than one token)
        self.num_preemptions = 0  # requests preempted (recomputed later) by the scheduler
        # phase -> host seconds spent in it over all steps ("execute" includes waiting for the device)
        self.step_seconds = {"schedule": 0.0, "execute": 0.0, "update": 0.0}

    # ---------- requests ----------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        bypass_cache: bool = False,
        capture_states: bool = False,
    ) -> str:
        """bypass_cache: a cold run that neither reads nor writes the prefix cache. capture_states: keep
        copies of the hit snapshot and of the state after the prompt (see `pop_captured_states`)."""
        params = params or SamplingParams()
        ids = self.validate_prompt(prompt)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, ids, params, next(self._order), bypass_cache=bypass_cache, capture_states=capture_states)
        self.output.add_request(req)
        self.requests[rid] = req
        self.scheduler.add(req)
        self.num_prompt_tokens += len(ids)
        return rid

    def validate_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, or ValueError naming what to change. Reads only immutable state (thread-safe)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model folder has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = as_token_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        capacity = self.cache.pools.pages.num_usable * self.config.page_size
        if len(ids) >= capacity:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the KV pool holds {capacity} tokens "
                f"(num_kv_pages x page_size): raise num_kv_pages or shorten the prompt"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)"
            )
        bad = next((t for t in ids if not 0 <= t < self.model_config.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt contains token id {bad}, outside the vocabulary [0, {self.model_config.vocab_size})"
            )
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.finish_reason = FinishReason.ABORT
        self._finish(req)
        out = self._retire(req)
        self._flush()
        self._settle_if_idle()
        return out

    def _finish(self, req: Request) -> None:
        """Ends req in the scheduler (its pages and slot are freed). If the in-flight step holds req, that step
        computes req's row (its last known token, or a prefill chunk): count it first, so a state published at
        release (no_buffer) covers exactly the tokens it is keyed by (the publishing copy is enqueued after that
        step)."""
        if self._inflight is not None:
            req.num_computed_tokens += self._inflight.sched.new_tokens_of(req)
        self.scheduler.finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---------- the step ----------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                outputs = [self._retire(r) for r in sched.finished]
                self._flush(sched.plan.publish_copies)
                return outputs
            self._capture_hits(sched)
            if not self.scheduler.may_launch(sched):
                t1 = time.perf_counter()
                return self._finish_step(sched, self.workers.execute(sched.plan), t0, t1, time.perf_counter())
            self._inflight = InFlight(sched, self.workers.launch(sched.plan))
        cur = self._inflight  # async scheduling: launch the next step before reading this one
        nxt = self.scheduler.lookahead(cur.sched, lambda req: self.output.reaches_length(req, 1))
        self._inflight = InFlight(nxt, self.workers.launch(nxt.plan)) if nxt is not None else None
        self.num_steps_ahead += nxt is not None
        self.num_prefill_steps_ahead += nxt is not None and nxt.has_prefill
        t1 = time.perf_counter()
        sampled = cur.pending.result()  # waits for cur's tokens only; the device goes on with nxt
        return self._finish_step(cur.sched, sampled, t0, t1, time.perf_counter()) + self._settle_if_idle()

    def _settle_if_idle(self) -> list[RequestOutput]:
        """With no unfinished request left, reads the in-flight step now: its rows belong to requests that ended
        while it ran (aborted, or stopped on the token it feeds), whose planned snapshot slots it drops. Nobody
        steps an engine without requests, so an engine never idles holding a launched step and its slots."""
        if self._inflight is None or self.requests:
            return []
        cur, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        sampled = cur.pending.result()
        return self._finish_step(cur.sched, sampled, t0, t0, time.perf_counter())

    def _finish_step(
        self, sched: SchedulerOutput, sampled: SamplerOutput, t0: float, t1: float, t2: float
    ) -> list[RequestOutput]:
        outputs = self._update(sched, sampled)
        self.num_preemptions += len(sched.preempted)
        self._flush()
        if self.config.debug_integrity:
            self.check_integrity()
        self._time_step(t0, t1, t2, time.perf_counter())
        return outputs

    def _flush(self, publish: tuple[tuple[int, int], ...] = ()) -> None:
        """Tells the ranks what happened since the last plan: states published (copied before a later step may
        reuse their live slots) and requests retired."""
        ops = SlotOps(publish + self.cache.take_publish_copies(), tuple(self._released))
        self._released.clear()
        if ops:
            self.workers.apply(ops)

    def _time_step(self, t0: float, t1: float, t2: float, t3: float) -> None:
        s = self.step_seconds
        s["schedule"] += t1 - t0
        s["execute"] += t2 - t1
        s["update"] += t3 - t2
        self.num_steps += 1

    def _update(self, sched: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        outputs, row = [self._retire(r) for r in sched.finished], 0
        for s in sched.scheduled:
            req = s.request
            if req.finish_reason is not None:  # ended while this step was in flight: its row is dropped
                row += int(s.sample)
                self.cache.drop_snapshots(s.snapshots)
                continue
            req.num_computed_tokens += s.num_new_tokens
            if req.capture_states and s.prefix_len < len(req.prompt_token_ids) <= req.num_computed_tokens:
                self._capture(req.request_id, "prompt", req.num_computed_tokens, req.live_slot)
            if s.snapshots:
                self.cache.publish(req, s.snapshots)
            if not s.sample:
                continue
            lp = sampled.logprobs[row] if sampled.logprobs else None
            top = sampled.top_logprobs[row] if sampled.top_logprobs else None
            self.output.append(req, sampled.token_ids[row], lp, top)
            self.num_generation_tokens += 1
            row += 1
            if req.finish_reason is not None:
                self._finish(req)
                outputs.append(self._retire(req))
            else:
                outputs.append(self.output.make_output(req))
        return outputs

    def _retire(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        out = self.output.make_output(req)
        self.output.release(req.request_id)
        self._released.append(req.request_id)
        return out

    # ---------- state capture (canary and audits) ----------
    def _capture_hits(self, sched: SchedulerOutput) -> None:
        for s in sched.scheduled:
            req = s.request
            if req.capture_states and req.cache_node is not None and "hit" not in self.captured.get(req.request_id, {}):
                self._capture(req.request_id, "hit", req.cache_node.depth, req.cache_node.snapshot_slot)

    def _capture(self, request_id: str, kind: str, num_tokens: int, slot: int) -> None:
        """A copy of one slot's state; under tp the ranks' parts are concatenated (conv channels and ssm heads in
        rank order: comparable with another capture of the same engine, not with a tp=1 layout)."""
        while len(self.captured) >= MAX_CAPTURED_REQUESTS and request_id not in self.captured:
            self.captured.pop(next(iter(self.captured)))  # nobody popped it: drop the oldest
        parts = self.workers.read_slot(slot)
        conv, ssm = (
            parts[0]
            if len(parts) == 1
            else (torch.cat([c for c, _ in parts], dim=1), torch.cat([s for _, s in parts], dim=1))
        )
        self.captured.setdefault(request_id, {})[kind] = CapturedState(num_tokens, conv, ssm)

    def pop_captured_states(self, request_id: str) -> dict[str, CapturedState]:
        """ "hit": the snapshot a capture_states request resumed from; "prompt": its state after the prompt."""
        return self.captured.pop(request_id, {})

    # ---------- convenience ----------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) and self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stats(self) -> dict[str, float]:
        c, pools = self.cache.counters, self.cache.pools
        tree = self.cache.tree
        return {
            "prefix_cache_queried_tokens": c.queried_tokens,
            "prefix_cache_hit_tokens": c.hit_tokens,
            "mamba_snapshot_hits": c.snapshot_hits,
            "mamba_snapshot_misses": c.snapshot_misses,
            "cache_evictions_kv": tree.num_evicted_pages if tree else 0,
            "cache_evictions_mamba": tree.num_evicted_snapshots if tree else 0,
            "kv_cache_usage_ratio": pools.kv_usage(),
            "mamba_cache_usage_ratio": pools.mamba_usage(),
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "snapshot_grid_tokens": self.cache.grid,
            "max_model_len": self.max_model_len,
            "num_kv_pages_free": pools.pages.num_free,
            "num_live_slots_free": pools.live.num_free,
            "num_snapshot_slots_free": pools.snapshots.num_free,
            **self.workers.memory_stats,
        }

    def cached_prefix_hashes(self, max_blocks: int = 100_000) -> list[int]:
        """Chained block hashes (block = snapshot grid) of every prefix the cache can resume from."""
        tree = self.cache.tree
        if tree is None:
            return []
        out: set[int] = set()
        for node, _depth in tree.snapshot_prefix_lengths():
            out.update(chained_block_hashes(tree.path_tokens(node), self.cache.grid))
            if len(out) >= max_blocks:
                break
        return list(out)[:max_blocks]

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        for req in self.scheduler.running:
            assert req.live_slot is not None and req.live_slot in self.cache.pools.live.in_use
            assert len(req.page_ids) * self.config.page_size >= req.num_computed_tokens

    def check_alive(self) -> None:
        """Raises if a rank process has died (the engine cannot step again)."""
        self.workers.check_alive()

    def shutdown(self) -> None:
        """Ends the rank processes (tp > 1); the engine cannot step afterwards."""
        self.workers.shutdown()
