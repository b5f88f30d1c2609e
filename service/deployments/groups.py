"""Grouped engine calls (docs/design.md: Serving): one Ray Serve call from an ingress replica to an engine replica
carries several requests, and its stream carries their deltas together, so Serve's per-call work (routing, gRPC,
the streaming generator's set-up, one response message per item) is paid per group instead of per request.

Ingress side: `GroupDispatcher.open(member)` returns the member's `MemberStream` at once. Members wait in the
dispatcher until its next flush: in the next pass of the event loop when no group call of this ingress replica is
being set up, else when the one being set up has reached its engine replica (its header came back), so a burst
fills groups by itself and a lone request waits for nothing. A group call's first item is a `GroupHeader` naming
the members its engine replica runs: the prefix-aware router keeps in a group only the members whose own routing
decision chose the group's replica (router.py), and the dispatcher sends the others again in the next group. Every
later item is a tuple of `GenerateChunk`s of several members (request id -> its delta), which the dispatcher hands
to each member's stream. A member stream cancelled before its group leaves is dropped from it; one cancelled after
asks every engine replica to abort that one request (`abort_requests`, broadcast). An error of one member is its
own chunk (`GenerateChunk.error`); only a failure of the whole call fails every member still running in it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.engine import SamplingParams

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from service.deployments.engine_deployment import GenerateChunk

logger = logging.getLogger("ray.serve")

GROUP_METHOD = "generate_group"  # the engine deployment method taking a GenerateGroup
ABORT_METHOD = "abort_requests"  # the engine deployment method aborting request ids (broadcast)


@dataclass(frozen=True)
class GroupMember:
    """One request of a group call (ingress -> engine replica)."""

    prompt_token_ids: list[int]  # prompt token ids
    sampling_params: SamplingParams
    request_id: str  # unique per choice; the engine's request id


@dataclass(frozen=True)
class GenerateGroup:
    """The argument of one `generate_group` call."""

    members: tuple[GroupMember, ...]  # in arrival order; the router may drop the ones routed elsewhere


@dataclass(frozen=True)
class GroupHeader:
    """The first item of a group call's stream (engine replica -> ingress)."""

    replica_id: str  # the engine replica's unique id
    accepted: tuple[str, ...]  # request ids this replica runs; every other member of the sent group was not started


class GroupCallEnded(RuntimeError):
    """The group call ended before this member's last chunk arrived."""


class MemberStream:
    """One request's chunks out of its group call; read it like a streaming DeploymentResponseGenerator (async
    iteration, `cancel()`). It ends after the chunk with `finish_reason` or `error` set."""

    def __init__(self, dispatcher: GroupDispatcher, member: GroupMember):
        self.member = member
        self._dispatcher = dispatcher
        self._queue: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self.sent = False  # its group call has left this ingress replica
        self.closed = False  # its last chunk (or a failure) is queued, or it was cancelled: nothing more comes
        self._drained = False  # the reader has taken the last item

    def push(self, chunk: GenerateChunk) -> None:
        if not self.closed:
            self.closed = chunk.finish_reason is not None or chunk.error is not None
            self._queue.put_nowait(chunk)

    def fail(self, exc: BaseException) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(exc)

    def cancel(self) -> None:
        """The reader is gone: drop the member from its pending group, or abort its request in the engine."""
        if not self.closed:
            self.closed = True
            self._drained = True
            self._dispatcher.cancel(self)

    def __aiter__(self) -> MemberStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._drained:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._drained = True
            raise item
        self._drained = item.finish_reason is not None or item.error is not None
        return item


class GroupDispatcher:
    """Groups this ingress replica's engine calls (module docstring). One per ingress replica, on its event loop."""

    def __init__(self, engine: DeploymentHandle, max_group_requests: int):
        self._engine = engine  # for the abort broadcast
        self._group_call = engine.options(
            method_name=GROUP_METHOD, stream=True, request_serialization="pickle", response_serialization="pickle"
        )
        self._max = max_group_requests
        self._pending: list[MemberStream] = []  # opened, not yet sent
        self._setting_up = 0  # group calls sent whose header has not come back
        self._flush_scheduled = False
        self._aborts: list[str] = []  # request ids to abort in the next broadcast
        self._tasks: set[asyncio.Task] = set()  # running group calls and abort broadcasts

    def open(self, member: GroupMember) -> MemberStream:
        stream = MemberStream(self, member)
        self._pending.append(stream)
        self._schedule_flush()
        return stream

    def cancel(self, stream: MemberStream) -> None:
        if not stream.sent:
            self._pending.remove(stream)
            return
        if not self._aborts:
            self._spawn(self._abort_soon())
        self._aborts.append(stream.member.request_id)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._pending:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        while self._pending and (self._setting_up == 0 or len(self._pending) >= self._max):
            group, self._pending = self._pending[: self._max], self._pending[self._max :]
            for s in group:
                s.sent = True
            self._setting_up += 1
            self._spawn(self._run(group))

    def _spawn(self, coro: Any) -> None:
        # a fresh context: the call gets its own Serve request id instead of the id of the HTTP request that flushed
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_soon(self) -> None:
        await asyncio.sleep(0)  # the cancellations of this loop pass go in one broadcast
        ids, self._aborts = self._aborts, []
        try:
            await self._engine.broadcast(ABORT_METHOD, ids).results_async()
        except Exception:  # a replica that is gone holds nothing to abort
            logger.warning("aborting %d requests on the engine replicas failed", len(ids), exc_info=True)

    async def _run(self, group: list[MemberStream]) -> None:
        """One group call: header, re-queue the members it does not run, then hand out chunks until all ended."""
        members = {s.member.request_id: s for s in group}
        call = self._group_call.remote(GenerateGroup(tuple(s.member for s in group)))
        setting_up = True
        try:
            header: GroupHeader = await call.__anext__()
            self._setting_up -= 1
            setting_up = False
            accepted = set(header.accepted)
            self._requeue([s for rid, s in members.items() if rid not in accepted])
            members = {rid: members[rid] for rid in header.accepted if rid in members}
            async for chunks in call:  # to its end: a member whose reader left ends when its abort arrives
                for chunk in chunks:
                    stream = members.get(chunk.request_id)
                    if stream is not None:
                        stream.push(chunk)
            for s in members.values():
                s.fail(GroupCallEnded(f"the engine call ended before request {s.member.request_id} finished"))
        except asyncio.CancelledError:
            call.cancel()  # the ingress is shutting down: the replica aborts every member still running
            for s in members.values():
                s.fail(GroupCallEnded("the ingress is shutting down"))
            raise
        except Exception as exc:  # the call failed (e.g. its replica died): every member still open gets it
            call.cancel()
            for s in members.values():
                s.fail(exc)
        finally:
            if setting_up:
                self._setting_up -= 1
            self._schedule_flush()

    def _requeue(self, streams: list[MemberStream]) -> None:
        """Members routed elsewhere go first into the next group (cancelled ones are dropped)."""
        again = [s for s in streams if not s.closed]
        for s in again:
            s.sent = False
        self._pending[:0] = again
        self._schedule_flush()
