"""Continuous batching with a per-step token budget, chunked prefill, prefill + decode mixed in one
step, admission on both pools, and preemption by recompute when KV pages run out. Each step's decisions go out
as a `StepPlan` (ids and tokens only) for the ranks; the look-ahead of async scheduling is decided here too."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.engine.cache.manager import CacheManager
from service.engine.distributed.step import SnapshotPoint, StepPlan, StepRow
from service.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request  # the (mutable) request; read-only during the forward
    prefix_len: int  # p: tokens already in the request's state before this step
    num_new_tokens: int  # l: tokens fed this step
    sample: bool  # this chunk ends at the last known token: sample the next one
    snapshots: tuple[SnapshotPoint, ...]  # states to snapshot during the forward
    carried: bool = False  # decodes the request's sample of the in-flight step (not known to the host yet)


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

    @property
    def has_prefill(self) -> bool:
        """Whether a row feeds more than one token (a prefill chunk)."""
        return _has_prefill(self.scheduled)

    def new_tokens_of(self, req: Request) -> int:
        """The tokens this step feeds req (0 when req has no row)."""
        return next((s.num_new_tokens for s in self.scheduled if s.request is req), 0)


def fed_tokens(req: Request, p: int, n: int) -> tuple[int, ...]:
    """Tokens at positions [p, p + n) of req's prompt followed by its outputs."""
    prompt, out = req.prompt_token_ids, req.output_token_ids
    lp = len(prompt)
    if p + n <= lp:
        return tuple(prompt[p : p + n])
    if p >= lp:
        return tuple(out[p - lp : p + n - lp])
    return tuple(prompt[p:]) + tuple(out[: p + n - lp])


def step_row(s: ScheduledRequest) -> StepRow:
    """The plan row of a scheduled request: ids, positions and the tokens it feeds (none when carried)."""
    req, p, n = s.request, s.prefix_len, s.num_new_tokens
    tokens = () if s.carried else fed_tokens(req, p, n)
    params = req.params if s.sample else None
    return StepRow(req.request_id, p, n, req.live_slot, tuple(req.page_ids), tokens, s.snapshots, params, s.carried)


def make_output(
    scheduled: tuple[ScheduledRequest, ...], copies=(), zeros=(), publish=(), preempted=(), finished=()
) -> SchedulerOutput:
    """A SchedulerOutput and its plan (copies: (src snapshot, dst live); zeros: live slots; publish: (live, snap))."""
    plan = StepPlan(tuple(step_row(s) for s in scheduled), tuple(copies), tuple(zeros), tuple(publish))
    return SchedulerOutput(scheduled, plan, tuple(preempted), tuple(finished))


def _has_prefill(out) -> bool:
    """Whether the step being built holds a row of more than one token."""
    return any(s.num_new_tokens > 1 for s in out)


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        launch_ahead: bool = False,
        prefill_align: int = 0,
    ):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.launch_ahead = launch_ahead  # async scheduling: steps are launched before the previous one's tokens
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
            p, known = req.num_computed_tokens, req.num_tokens
            n = self._cut(p, known, min(known - p, budget), out)
            if n == 0:  # no chunk end within the budget left: the request's prefill goes on next step
                i += 1
                continue
            if not self._grow_or_preempt(req, n, preempted, finished):
                continue  # req itself was preempted or finished: the list shrank
            out.append(self._scheduled(req, p, n, known))
            budget -= n
            i += 1
        if not preempted:
            self._admit(out, budget, copies, zeros, ahead=False)
        return make_output(tuple(out), copies, zeros, self.cache.take_publish_copies(), preempted, finished)

    def _admit(self, out: list[ScheduledRequest], budget: int, copies: list, zeros: list, ahead: bool) -> None:
        """Admits waiting requests in order while seats, memory and budget last: their first chunks join `out`
        (copies: (snapshot, live slot) of cache hits; zeros: fresh live slots). ahead: the step is launched
        ahead, where a request that captures states is not admitted (its capture reads the state after the step)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if budget < self.prefill_align and _has_prefill(out):
                break  # it could only be cut mid-chunk: admitted next step
            if ahead and req.capture_states:
                break
            n = self.cache.admit(req, budget)
            if n is None:
                break
            n = self._cut(req.num_computed_tokens, req.num_tokens, n, out) or n
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            copy = self.cache.initial_slot_copy(req)
            copies.append(copy) if copy else zeros.append(req.live_slot)
            out.append(self._scheduled(req, req.num_computed_tokens, n, req.num_tokens))
            budget -= n

    # ---------- async scheduling ----------
    def may_launch(self, sched: SchedulerOutput) -> bool:
        """Whether sched can be launched without waiting for its tokens: async scheduling is on and no row captures
        states (a capture reads the state right after the step)."""
        return self.launch_ahead and not any(s.request.capture_states for s in sched.scheduled)

    def lookahead(self, cur: SchedulerOutput, ends_next: Callable[[Request], bool]) -> SchedulerOutput | None:
        """The step after the in-flight `cur`, planned before cur's tokens are read, as `schedule` plans it with
        every running request where cur leaves it: one that samples in cur decodes that sample (carried: cur's
        token, read on the device; a request that stops on it costs one wasted row, and the token it feeds is
        real, so its KV and state stay right), one mid-prefill feeds its next chunk; then waiting requests are
        admitted (a state that cur publishes is not hit yet). ends_next(req): req ends on cur's token whatever it
        is (length). None: decide after cur's results (a row would need preemption or captures states, or there
        is nothing to run). Allocates the rows' pages and snapshot slots."""
        if not self.launch_ahead or (
            self.waiting and self.waiting[0].capture_states and len(self.running) < self.max_num_seqs
        ):
            return None
        rows = self._next_rows({id(s.request): s for s in cur.scheduled}, ends_next)
        if rows is None:
            return None
        budget = self.token_budget - sum(s.num_new_tokens for s in rows)
        out = [self._with_snapshots(s) for s in rows] if self.cache.plans_snapshots else rows
        copies: list[tuple[int, int]] = []
        zeros: list[int] = []
        self._admit(out, budget, copies, zeros, ahead=True)
        if not out:
            return None
        return make_output(tuple(out), copies, zeros, self.cache.take_publish_copies())

    def _next_rows(
        self, in_cur: dict[int, ScheduledRequest], ends_next: Callable[[Request], bool]
    ) -> list[ScheduledRequest] | None:
        """The running requests' rows of the step after cur (in_cur: id(request) -> its row in cur) with their
        pages, no snapshots planned yet; None if one would not get its pages without preemption or captures states
        (nothing is held then but pages the requests need anyway)."""
        rows, budget = [], self.token_budget
        for req in self.running:
            if budget <= 0:
                break
            s = in_cur.get(id(req))
            carried = s is not None and s.sample
            if carried and ends_next(req):
                continue
            p = req.num_computed_tokens if s is None else s.prefix_len + s.num_new_tokens
            known = req.num_tokens + carried  # cur's sample is known to the device only
            n = min(known - p, budget)
            if p + n < known and (n := self._cut(p, known, n, rows)) == 0:
                continue
            if req.capture_states or not self.cache.grow(req, p + n):
                return None
            rows.append(ScheduledRequest(req, p, n, p + n == known, (), carried))
            budget -= n
        return rows

    def _cut(self, p: int, num_tokens: int, n: int, out: list[ScheduledRequest]) -> int:
        """The tokens to feed a request with p computed of its num_tokens known tokens this step when n fit the
        budget: n if they reach its last known token, else n rounded down to a multiple of prefill_align (absolute
        positions). 0 when that leaves none and the step (its rows so far: out) already holds a prefill chunk; the
        step's first prefill takes n unrounded then, so some prefill always progresses (with a budget of at least
        max_num_seqs - 1 + prefill_align the first one always ends on a chunk end)."""
        a = self.prefill_align
        if a <= 1 or p + n >= num_tokens:
            return n
        m = (p + n) // a * a - p
        if m > 0:
            return m
        return 0 if _has_prefill(out) else n

    def _scheduled(self, req: Request, p: int, n: int, num_tokens: int) -> ScheduledRequest:
        """req's row feeding tokens [p, p + n) of its num_tokens known ones, with its snapshot slots allocated."""
        return self._with_snapshots(ScheduledRequest(req, p, n, p + n == num_tokens, ()))

    def _with_snapshots(self, s: ScheduledRequest) -> ScheduledRequest:
        """s with its snapshot points planned (slots allocated). A carried row decodes: its request has an output
        (cur's sample) even when req holds none yet."""
        req, n = s.request, s.num_new_tokens
        decode = n == 1 and (s.carried or len(req.output_token_ids) > 0)
        snapshots = self.cache.plan_snapshots(req, s.prefix_len, n, decode)
        return replace(s, snapshots=snapshots) if snapshots else s

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
