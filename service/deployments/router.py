"""Prefix-aware Ray Serve `RequestRouter` for the engine deployment (docs/design.md: Serving).

Runs inside whichever process holds the engine's DeploymentHandle (the OpenAI ingress). For a
`generate(prompt_token_ids, ...)` call it hashes the prompt's blocks (block = the engine's snapshot
grid, published by each replica's `record_replica_metadata`), scores the candidates with
`prefix_index.decide` and returns them one per rank, best first. A `generate_group(GenerateGroup)` call is
decided per member, in order (groups.py): the call goes where its first member chose, and the members that chose
another replica are taken out of the call's argument before it is sent. All state is router-local and
updated without remote calls: the index and the in-flight count at dispatch (`on_request_routed`),
the count again at completion, the index from the replicas' periodic routing stats
(`cached_prefix_hashes`, applied when Serve broadcasts new replica info).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from service.deployments.groups import GROUP_METHOD, GenerateGroup
from service.deployments.metrics import RouterMetrics
from service.deployments.prefix_index import Decision, ReplicaPrefixIndex, ReplicaView, RouterPolicy, decide
from service.engine.cache.block_hash import chained_block_hashes

logger = logging.getLogger("ray.serve")

GENERATE_METHOD = "generate"  # the engine deployment method whose first argument is the prompt's token ids
_MAX_REMEMBERED_REQUESTS = 65_536  # bound on per-request state kept between choose and dispatch/completion


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids of a `generate` call, or None for any other call."""
    if pending_request is None or pending_request.metadata.call_method != GENERATE_METHOD:
        return None
    ids = pending_request.kwargs.get("prompt_token_ids")
    if ids is None and pending_request.args:
        ids = pending_request.args[0]
    return list(ids) if isinstance(ids, (list, tuple)) else None


def request_group(pending_request: PendingRequest | None) -> GenerateGroup | None:
    """The `GenerateGroup` argument of a `generate_group` call, or None for any other call."""
    if pending_request is None or pending_request.metadata.call_method != GROUP_METHOD or not pending_request.args:
        return None
    group = pending_request.args[0]
    return group if isinstance(group, GenerateGroup) else None


class PrefixAwareRouter(RequestRouter):
    """`request_router_kwargs` are `RouterPolicy` fields plus `default_block_size_tokens` (used until a
    replica publishes its snapshot grid)."""

    def initialize_state(self, default_block_size_tokens: int = 64, **policy_kwargs: Any) -> None:
        self._policy = RouterPolicy(**policy_kwargs)
        self._default_block_size_tokens = int(default_block_size_tokens)
        self._indexes: dict[ReplicaID, ReplicaPrefixIndex] = {}
        self._in_flight: dict[ReplicaID, int] = {}
        self._dispatched_total: dict[ReplicaID, int] = {}
        self._report_seq: dict[ReplicaID, Any] = {}
        # id(PendingRequest) -> (that request, (block hashes, decision) per request it carries: one, or one per
        # member of a group), from choose_replicas to on_request_routed
        self._decisions: OrderedDict[int, tuple[PendingRequest, list[tuple[list[int], Decision]]]] = OrderedDict()
        # internal request id -> (replica, requests carried) per call dispatched, until on_request_completed. Every
        # handle call made while serving one HTTP request shares that request's internal id (n > 1 choices).
        self._routed: OrderedDict[str, list[tuple[ReplicaID, int]]] = OrderedDict()
        self._metrics = RouterMetrics()

    # ---- replica set and reports ----
    def _index(self, replica_id: ReplicaID) -> ReplicaPrefixIndex:
        index = self._indexes.get(replica_id)
        if index is None:
            index = self._indexes[replica_id] = ReplicaPrefixIndex(self._policy.index_capacity_blocks)
        return index

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [k for k in self._indexes if k not in live]:
            self._forget(gone)
        for r in replicas:
            stats = r.routing_stats or {}
            seq = stats.get("report_seq")
            if seq is None or self._report_seq.get(r.replica_id) == seq:
                continue
            self._report_seq[r.replica_id] = seq
            self._index(r.replica_id).apply_report(stats.get("cached_prefix_hashes", ()), self._policy.report_grace_s)
            # completions that never reached on_request_completed (killed callers, cancelled streams) would
            # otherwise leak in-flight counts forever and steer every request away from this replica
            reported = int(stats.get("num_requests_running", 0)) + int(stats.get("num_requests_waiting", 0))
            if self._in_flight.get(r.replica_id, 0) > reported:
                self._in_flight[r.replica_id] = reported

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        for table in (self._indexes, self._in_flight, self._dispatched_total, self._report_seq):
            table.pop(replica_id, None)

    def _block_size_tokens(self, replicas: list[RunningReplica]) -> int:
        for r in replicas:
            grid = r.replica_metadata.get("snapshot_grid_tokens")
            if grid:
                return int(grid)
        return self._default_block_size_tokens

    # ---- routing ----
    def _decide(
        self, replicas: list[RunningReplica], ids: list[int] | None, block: int, extra: dict[ReplicaID, int]
    ) -> tuple[list[int], Decision]:
        """One prompt's block hashes and decision; `extra` in-flight requests per replica are added to the counts."""
        hashes = chained_block_hashes(ids, block) if ids else []
        views = [
            ReplicaView(
                replica_key=r.replica_id,
                matched_blocks=self._index(r.replica_id).match_blocks(hashes),
                in_flight=self._in_flight.get(r.replica_id, 0) + extra.get(r.replica_id, 0),
                dispatched_total=self._dispatched_total.get(r.replica_id, 0),
                indexed_blocks=len(self._index(r.replica_id)),
            )
            for r in replicas
        ]
        return hashes, decide(views, len(hashes), self._policy, has_prompt=ids is not None)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        block = self._block_size_tokens(candidate_replicas)
        group = request_group(pending_request)
        if group is not None and group.members:
            decisions = self._group_decisions(candidate_replicas, pending_request, group, block)
        else:
            decisions = [self._decide(candidate_replicas, prompt_token_ids(pending_request), block, {})]
        if pending_request is not None:
            self._remember(self._decisions, id(pending_request), (pending_request, decisions))
            # after every rank was tried once, let Serve back off instead of spinning
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[k]] for k in decisions[0][1].ranking]

    def _group_decisions(
        self, replicas: list[RunningReplica], pending_request: PendingRequest, group: GenerateGroup, block: int
    ) -> list[tuple[list[int], Decision]]:
        """Each member's own decision, in order, each counting the members before it as in flight where they
        chose. The call goes where the first member chose; members that chose another replica leave the group
        (the ingress sends them again in its next group, see groups.py)."""
        extra: dict[ReplicaID, int] = {}
        kept, decisions = [], []
        for member in group.members:
            hashes, decision = self._decide(replicas, member.prompt_token_ids, block, extra)
            target = decision.ranking[0]
            if decisions and target != decisions[0][1].ranking[0]:
                continue
            extra[target] = extra.get(target, 0) + 1
            kept.append(member)
            decisions.append((hashes, decision))
        if len(kept) < len(group.members):
            pending_request.args[0] = dataclasses.replace(group, members=tuple(kept))
        return decisions

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any | None = None) -> None:
        """Give the chosen replica to exactly the request it was chosen for. (Serve's default matches on
        internal_request_id, which concurrent calls of one HTTP request share, so the second of n choices
        would never be assigned; FIFO matching would hand a prefix-aware choice to another prompt.)"""
        for pr in self._pending_requests_to_fulfill:
            if pr.metadata is request_metadata and not pr.future.done():
                self._cancel_routing_task_for_pending_request(pr)
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                if self._pending_requests_by_id.get(pr.metadata.internal_request_id) is pr:
                    self._remove_pending_request_from_indices(pr)
                return

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Per request (every member of a group): in flight and dispatched on `replica_id`, the decision's metric,
        its prompt's blocks into the replica's index."""
        remembered = self._decisions.pop(id(pending_request), None)
        decisions = remembered[1] if remembered and remembered[0] is pending_request else [([], None)]
        count = len(decisions)
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + count
        self._dispatched_total[replica_id] = self._dispatched_total.get(replica_id, 0) + count
        request_id = pending_request.metadata.internal_request_id
        self._remember(self._routed, request_id, self._routed.get(request_id, []) + [(replica_id, count)])
        index = self._index(replica_id)
        for hashes, decision in decisions:
            if decision is not None and decision.ranking[0] == replica_id:
                self._metrics.record_decision(decision.reason, decision.predicted_hit_ratio)
            elif decision is not None:
                self._metrics.record_decision("fallback", index.match_blocks(hashes) / len(hashes) if hashes else 0.0)
            if hashes:
                index.insert(hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A call ended: its requests leave the replica's in-flight count. (The members of a group that end
        earlier leave it when the replica next reports its running + waiting requests, update_replicas.)"""
        routed = self._routed.get(internal_request_id)
        entry = next((e for e in routed or () if e[0] == replica_id), None)
        if entry is None:
            return
        routed.remove(entry)
        if not routed:
            del self._routed[internal_request_id]
        self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - entry[1])

    @staticmethod
    def _remember(table: OrderedDict, key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _MAX_REMEMBERED_REQUESTS:
            table.popitem(last=False)
