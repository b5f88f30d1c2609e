"""Continuous batching with a per-step token budget, chunked prefill, prefill + decode mixed in one
step, admission on both pools, and preemption by recompute when KV pages run out."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from service.engine.cache.manager import CacheManager, SnapshotPoint
from service.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request                          # the (mutable) request; read-only during the forward
    prefix_len: int                           # p: tokens already in the request's state before this step
    num_new_tokens: int                       # l: tokens fed this step
    sample: bool                              # this chunk ends at the last known token: sample the next one
    snapshots: tuple[SnapshotPoint, ...]      # states to snapshot during the forward


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]   # in batch order
    slot_copies: tuple[tuple[int, int], ...]  # (src snapshot slot, dst live slot) to copy before the forward
    slot_zeros: tuple[int, ...]               # fresh live slots to zero before the forward
    preempted: tuple[str, ...]                # request ids preempted this step (will be recomputed)
    finished: tuple[Request, ...] = ()        # finished by the scheduler: alone and the KV pool is full ("length")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()   # FIFO; preempted requests go back to the front
        self.running: list[Request] = []         # admission order

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        out: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        zeros: list[int] = []
        preempted: list[str] = []
        finished: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow_or_preempt(req, n, preempted, finished):
                continue  # req itself was preempted or finished: the list shrank
            out.append(self._scheduled(req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = self.cache.admit(req, budget)
            if n is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            copy = self.cache.initial_slot_copy(req)
            copies.append(copy) if copy else zeros.append(req.live_slot)
            out.append(self._scheduled(req, n))
            budget -= n
        return SchedulerOutput(tuple(out), tuple(copies), tuple(zeros), tuple(preempted), tuple(finished))

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        sample = req.num_computed_tokens + n == req.num_tokens
        return ScheduledRequest(req, req.num_computed_tokens, n, sample, self.cache.plan_snapshots(req, n))

    def _grow_or_preempt(self, req: Request, n: int, preempted: list[str], finished: list[Request]) -> bool:
        """Pages for req's next n tokens, preempting the most recently admitted requests if needed.
        A request that is alone and still does not fit can never progress: it finishes with "length"."""
        while not self.cache.grow(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1 and req.output_token_ids:
                req.finish_reason = FinishReason.LENGTH
                self.finish(req)
                finished.append(req)
                return False
            self.preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop all state, requeue at the front (outputs are kept)."""
        self.running.remove(req)
        self.cache.release(req, finished=False)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req, finished=True)
        req.status = RequestStatus.FINISHED
