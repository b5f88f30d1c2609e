"""Continuous batching with a per-step token budget, chunked prefill, prefill + decode mixed in one
step, admission on both pools, and preemption by recompute when KV pages run out. Each step's decisions go out
as a `StepPlan` (ids and tokens only) for the ranks; the look-ahead of async scheduling is decided here too."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from service.engine.cache.manager import CacheManager
from service.engine.distributed.step import LaunchLimits, SnapshotPoint, StepPlan, StepRow, is_launchable
from service.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request  # the (mutable) request; read-only during the forward
    prefix_len: int  # p: tokens already in the request's state before this step
    num_new_tokens: int  # l: tokens fed this step
    sample: bool  # this chunk ends at the last known token: sample the next one
    snapshots: tuple[SnapshotPoint, ...]  # states to snapshot during the forward


@dataclass(frozen=True)
class SchedulerOutput:
    """The engine's view of a step (live requests) and the ranks' view of it (`plan`, row i = scheduled[i])."""

    scheduled: tuple[ScheduledRequest, ...]  # in batch order
    plan: StepPlan  # the message every rank runs
    preempted: tuple[str, ...] = ()  # request ids preempted this step (will be recomputed)
    finished: tuple[Request, ...] = ()  # finished by the scheduler: alone and the KV pool is full ("length")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def holds(self, req: Request) -> bool:
        return any(s.request is req for s in self.scheduled)


def fed_tokens(req: Request, p: int, n: int) -> tuple[int, ...]:
    """Tokens at positions [p, p + n) of req's prompt followed by its outputs."""
    prompt, out = req.prompt_token_ids, req.output_token_ids
    lp = len(prompt)
    if p + n <= lp:
        return tuple(prompt[p : p + n])
    if p >= lp:
        return tuple(out[p - lp : p + n - lp])
    return tuple(prompt[p:]) + tuple(out[: p + n - lp])


def step_row(s: ScheduledRequest, carried: bool = False) -> StepRow:
    """The plan row of a scheduled request: ids, positions and the tokens it feeds (none when carried)."""
    req, p, n = s.request, s.prefix_len, s.num_new_tokens
    tokens = () if carried else fed_tokens(req, p, n)
    return StepRow(
        req.request_id, p, n, req.live_slot, tuple(req.page_ids), tokens, s.snapshots, req.params if s.sample else None
    )


def make_output(
    scheduled: tuple[ScheduledRequest, ...],
    copies=(),
    zeros=(),
    publish=(),
    preempted=(),
    finished=(),
    carried: bool = False,
) -> SchedulerOutput:
    """A SchedulerOutput and its plan (copies: (src snapshot, dst live); zeros: live slots; publish: (live, snap))."""
    plan = StepPlan(
        tuple(step_row(s, carried) for s in scheduled), tuple(copies), tuple(zeros), tuple(publish), carried
    )
    return SchedulerOutput(scheduled, plan, tuple(preempted), tuple(finished))


def _has_prefill(out: list[ScheduledRequest]) -> bool:
    """Whether the step being built holds a row of more than one token."""
    return any(s.num_new_tokens > 1 for s in out)


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        launch_limits: LaunchLimits | None = None,
        prefill_align: int = 0,
    ):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.launch_limits = launch_limits  # None: never launch ahead (async scheduling off)
        # a prefill cut by the token budget ends at a multiple of this many tokens (0: anywhere); set to the SSD
        # chunk size when the SSM state pool rounds states (bf16): the scan rounds at chunk ends, a step's end
        # rounds too, so cuts at chunk ends keep a request's numbers independent of how its prompt was cut
        self.prefill_align = prefill_align
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests go back to the front
        self.running: list[Request] = []  # admission order

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
            n = self._cut(req, min(req.num_tokens - req.num_computed_tokens, budget), out)
            if n == 0:  # no chunk end within the budget left: the request's prefill goes on next step
                i += 1
                continue
            if not self._grow_or_preempt(req, n, preempted, finished):
                continue  # req itself was preempted or finished: the list shrank
            out.append(self._scheduled(req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if budget < self.prefill_align and _has_prefill(out):
                break  # it could only be cut mid-chunk: admitted next step
            n = self.cache.admit(req, budget)
            if n is None:
                break
            n = self._cut(req, n, out) or n
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            copy = self.cache.initial_slot_copy(req)
            copies.append(copy) if copy else zeros.append(req.live_slot)
            out.append(self._scheduled(req, n))
            budget -= n
        return make_output(tuple(out), copies, zeros, self.cache.take_publish_copies(), preempted, finished)

    # ---------- async scheduling ----------
    def may_launch(self, sched: SchedulerOutput) -> bool:
        """Whether sched can be launched without waiting for its tokens: a plain decode step the ranks can launch,
        and no row captures states (a capture reads the state right after the step)."""
        return (
            self.launch_limits is not None
            and is_launchable(sched.plan, self.launch_limits)
            and not any(s.request.capture_states for s in sched.scheduled)
        )

    def lookahead(self, cur: SchedulerOutput, ends_next: Callable[[Request], bool]) -> SchedulerOutput | None:
        """The step after the in-flight `cur`, when it is certain without cur's tokens: nobody waits for a free
        seat, and each of cur's requests that can go on decodes one more token, no snapshot due (a request that
        stops on cur's token costs one wasted row; the token it feeds is real, so its KV and state stay right).
        ends_next(req): req ends on cur's token whatever it is (length). None: decide after cur's results.
        Allocates the rows' pages. The plan's tokens are carried: cur's samples, on the device."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        in_cur = {id(s.request) for s in cur.scheduled}
        if any(id(r) not in in_cur for r in self.running):  # someone waits for budget (a prefill cut to chunk ends)
            return None
        rows = []
        for s in cur.scheduled:
            req = s.request
            if req.finish_reason is not None or ends_next(req):
                continue
            p = s.prefix_len + 1  # cur feeds position s.prefix_len; the next step feeds the token after
            if self.cache.decode_snapshot_due(req, p) or not self.cache.grow(req, p + 1):
                return None
            rows.append(ScheduledRequest(req, p, 1, True, ()))
        nxt = make_output(tuple(rows), carried=True)
        ok = 0 < len(rows) <= self.token_budget and is_launchable(nxt.plan, self.launch_limits)
        return nxt if ok else None

    def _cut(self, req: Request, n: int, out: list[ScheduledRequest]) -> int:
        """The tokens to feed req this step when n fit the budget: n if they reach its last known token, else n
        rounded down to a multiple of prefill_align (absolute positions). 0 when that leaves none and the step
        already holds a prefill chunk; the step's first prefill takes n unrounded then, so some prefill always
        progresses (with a budget of at least max_num_seqs - 1 + prefill_align the first one always ends on a
        chunk end)."""
        a, p = self.prefill_align, req.num_computed_tokens
        if a <= 1 or p + n >= req.num_tokens:
            return n
        m = (p + n) // a * a - p
        if m > 0:
            return m
        return 0 if _has_prefill(out) else n

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
