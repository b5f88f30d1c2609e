"""The synchronous engine: `step()` = schedule -> run -> update."""
from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Sequence

from service.engine.cache.block_hash import chained_block_hashes
from service.engine.cache.manager import CacheManager
from service.engine.config import EngineConfig, ModelConfig
from service.engine.output import OutputProcessor
from service.engine.request import CapturedState, FinishReason, Request, RequestOutput, SamplingParams
from service.engine.runner.model_runner import InFlightStep, ModelRunner
from service.engine.runner.sampler import SamplerOutput
from service.engine.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from service.engine.tokenizer import Tokenizer


MAX_CAPTURED_REQUESTS = 64   # state copies kept for capture_states requests until popped


class Engine:
    def __init__(self, config: EngineConfig, model=None):
        config = config.resolved()
        config.validate()
        if config.tp != 1 or config.ep != 1:
            raise ValueError(f"tp={config.tp}, ep={config.ep}: tensor/expert parallelism inside one engine is not "
                             "implemented yet; use tp=1, ep=1 and scale out with replicas")
        self.config = config
        self.model_config = ModelConfig.from_model_path(config.model_path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        has_tok = os.path.exists(os.path.join(config.model_path, "tokenizer.json"))
        self.tokenizer = Tokenizer.from_model_path(config.model_path) if has_tok else None
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, model)
        self.cache = CacheManager(self.runner.pools, config.mamba_cache_strategy, config.page_size,
                                  self.model_config.chunk_size, config.mamba_track_interval)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_id
        self.output = OutputProcessor(self.tokenizer, tuple(eos), self.max_model_len)
        self.requests: dict[str, Request] = {}   # request_id -> unfinished request
        self.captured: dict[str, dict[str, CapturedState]] = {}  # request_id -> "hit"|"prompt" -> state copy
        self._order = itertools.count()
        self._inflight: InFlightStep | None = None   # launched step whose results are not read yet (async)
        self.num_prompt_tokens = 0               # prompt tokens of admitted requests
        self.num_generation_tokens = 0           # tokens sampled
        self.num_steps = 0                       # steps that ran a forward
        self.num_steps_ahead = 0                 # steps launched before the previous step's tokens were read
        # phase -> host seconds spent in it over all steps ("execute" includes waiting for the device)
        self.step_seconds = {"schedule": 0.0, "execute": 0.0, "update": 0.0}

    # ---------- requests ----------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, bypass_cache: bool = False, capture_states: bool = False) -> str:
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
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        capacity = self.runner.pools.pages.num_usable * self.config.page_size
        if len(ids) >= capacity:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds {capacity} tokens "
                             f"(num_kv_pages x page_size): raise num_kv_pages or shorten the prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one generated token must fit)")
        bad = next((t for t in ids if not 0 <= t < self.model_config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt contains token id {bad}, outside the vocabulary [0, "
                             f"{self.model_config.vocab_size})")
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.finish_reason = FinishReason.ABORT
        self._finish(req)
        return self._retire(req)

    def _finish(self, req: Request) -> None:
        """Ends req in the scheduler (its pages and slot are freed). If the in-flight step holds req, that step
        computes req's last known token: count it first, so a state published at release (no_buffer) covers
        exactly the tokens it is keyed by (the publishing copy is enqueued after that step)."""
        if self._inflight is not None and self._inflight.holds(req):
            req.num_computed_tokens += 1
        self.scheduler.finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---------- the step ----------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                return [self._retire(r) for r in sched.finished]
            self._capture_hits(sched)
            if not self._may_launch_ahead(sched):
                t1 = time.perf_counter()
                return self._finish_step(sched, self.runner.execute(sched), t0, t1, time.perf_counter())
            self._inflight = self.runner.launch(sched)
        cur = self._inflight                 # async scheduling: launch the next step before reading this one
        nxt = self._lookahead(cur)
        self._inflight = self.runner.launch(nxt, prev=cur) if nxt is not None else None
        self.num_steps_ahead += nxt is not None
        t1 = time.perf_counter()
        sampled = cur.host.result()          # waits for cur's tokens only; the device goes on with nxt
        return self._finish_step(cur.sched, sampled, t0, t1, time.perf_counter())

    def _finish_step(self, sched: SchedulerOutput, sampled: SamplerOutput, t0: float, t1: float,
                     t2: float) -> list[RequestOutput]:
        outputs = self._update(sched, sampled)
        if self.config.debug_integrity:
            self.check_integrity()
        self._time_step(t0, t1, t2, time.perf_counter())
        return outputs

    def _may_launch_ahead(self, sched: SchedulerOutput) -> bool:
        return (self.config.async_scheduling and self.runner.can_launch(sched)
                and not any(s.request.capture_states for s in sched.scheduled))

    def _lookahead(self, cur: InFlightStep) -> SchedulerOutput | None:
        """The step after the in-flight `cur`, when it is certain without cur's tokens: nobody waits for a free
        seat, and each of cur's requests that can go on decodes one more token, no snapshot due (a request that
        stops on cur's token costs one wasted row; the token it feeds is real, so its KV and state stay right).
        None: the scheduler decides after cur's results. Allocates the rows' pages."""
        sch = self.scheduler
        if sch.waiting and len(sch.running) < sch.max_num_seqs:
            return None
        rows = []
        for s in cur.sched.scheduled:
            req = s.request
            if req.finish_reason is not None or self.output.reaches_length(req, 1):   # ends on cur's token
                continue
            p = s.prefix_len + 1           # cur feeds position s.prefix_len; the next step feeds the token after
            if self.cache.decode_snapshot_due(req, p) or not self.cache.grow(req, p + 1):
                return None
            rows.append(ScheduledRequest(req, p, 1, True, ()))
        nxt = SchedulerOutput(tuple(rows), (), (), ())
        ok = 0 < len(rows) <= sch.token_budget and self.runner.can_launch(nxt)
        return nxt if ok else None

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
            if req.finish_reason is not None:    # ended while this step was in flight: its row is dropped
                row += int(s.sample)
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
        self.runner.release(req.request_id)
        return out

    # ---------- state capture (canary and audits) ----------
    def _capture_hits(self, sched: SchedulerOutput) -> None:
        for s in sched.scheduled:
            req = s.request
            if req.capture_states and req.cache_node is not None and "hit" not in self.captured.get(req.request_id, {}):
                self._capture(req.request_id, "hit", req.cache_node.depth, req.cache_node.snapshot_slot)

    def _capture(self, request_id: str, kind: str, num_tokens: int, slot: int) -> None:
        pools = self.runner.pools
        while len(self.captured) >= MAX_CAPTURED_REQUESTS and request_id not in self.captured:
            self.captured.pop(next(iter(self.captured)))       # nobody popped it: drop the oldest
        self.captured.setdefault(request_id, {})[kind] = CapturedState(
            num_tokens, pools.conv[:, slot].clone(), pools.ssm[:, slot].clone())

    def pop_captured_states(self, request_id: str) -> dict[str, "CapturedState"]:
        """"hit": the snapshot a capture_states request resumed from; "prompt": its state after the prompt."""
        return self.captured.pop(request_id, {})

    # ---------- convenience ----------
    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
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
        c, pools = self.cache.counters, self.runner.pools
        tree = self.cache.tree
        return {
            "prefix_cache_queried_tokens": c.queried_tokens, "prefix_cache_hit_tokens": c.hit_tokens,
            "mamba_snapshot_hits": c.snapshot_hits, "mamba_snapshot_misses": c.snapshot_misses,
            "cache_evictions_kv": tree.num_evicted_pages if tree else 0,
            "cache_evictions_mamba": tree.num_evicted_snapshots if tree else 0,
            "kv_cache_usage_ratio": pools.kv_usage(), "mamba_cache_usage_ratio": pools.mamba_usage(),
            "num_requests_running": len(self.scheduler.running), "num_requests_waiting": len(self.scheduler.waiting),
            "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generation_tokens,
            "snapshot_grid_tokens": self.cache.grid, "max_model_len": self.max_model_len,
            "num_kv_pages_free": pools.pages.num_free, "num_live_slots_free": pools.live.num_free,
            "num_snapshot_slots_free": pools.snapshots.num_free,
            **(self.runner.memory_plan.stats() if self.runner.memory_plan is not None else {}),
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
            assert req.live_slot is not None and req.live_slot in self.runner.pools.live.in_use
            assert len(req.page_ids) * self.config.page_size >= req.num_computed_tokens
