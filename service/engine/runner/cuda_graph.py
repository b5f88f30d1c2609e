"""CUDA-graph capture and replay of decode-only steps (docs/design.md: Scheduler and runner).

At start, the model's forward for a decode-only batch is captured once per batch-size bucket (largest first, one
shared memory pool): powers of two up to 256, then every LARGE_BUCKET_STEP rows up to max_num_seqs, so a step of
any size up to max_num_seqs is replayed (padding at most a factor of 2 below 256, at most 127 rows above). Every
bucket writes its logits into the first rows of one static buffer [max bucket, vocab] fp32, so the captured
graphs hold one logits buffer, not one per bucket (`graph_memory_bytes` is what the memory plan keeps for them).
A step whose requests all decode one token, all sample and take no snapshot, and that fits a bucket, is replayed: its inputs are copied into the static buffers (two host-to-device copies), padding rows point
at the scratch mamba slot 0 and the scratch KV page 0 (both reserved in cache/pools.py, never handed out), and the
graph writes the bucket's logits buffer. Sampling stays outside the graph.

The attention split plan of a captured step is sized from the page table's width (`max_seq_len` =
max_pages * page_size), not from the step's lengths, so one graph serves every context length up to
max_model_len.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from service.engine.distributed.step import LaunchLimits, StepPlan, is_launchable
from service.engine.layers.meta import AttentionMeta, MambaMeta, SnapshotPlan
from service.engine.model.nemotron_h import NemotronHForCausalLM
from service.engine.runner.batch import scheduled_token_ids
from service.engine.runner.state_tensors import StateTensors

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # powers of two: the buckets up to 256 rows
LARGE_BUCKET_STEP = 128  # rows between buckets above 256
_FIELDS = 4  # rows of the small static buffer: input ids, slot ids, kv slot mapping, prefix lens


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: powers of two up to the first one that holds max_num_seqs (at most 256), then
    multiples of LARGE_BUCKET_STEP above 256, the last one max_num_seqs itself."""
    out = []
    for b in BATCH_BUCKETS:
        out.append(b)
        if b >= max_num_seqs:
            return tuple(out)
    b = BATCH_BUCKETS[-1]
    while b < max_num_seqs:
        b = min(b + LARGE_BUCKET_STEP, max_num_seqs)
        out.append(b)
    return tuple(out)


def graph_memory_bytes(buckets: tuple[int, ...], vocab_size: int, hidden_size: int, num_segments: int) -> int:
    """Bytes the captured graphs keep (an upper estimate the memory plan reserves): the static logits [max bucket,
    vocab] fp32, the largest bucket's transient peak (its logits in the model dtype, and in fp32 at tp > 1 before
    the copy into the static buffer, plus a GRAPH_SLACK_BYTES allowance for the layers' activations and cuBLAS
    workspaces), and
    every bucket's segment outputs (x and the residual h, [b, hidden], up to 4 bytes each, at each segment end)."""
    top = max(buckets)
    logits = top * vocab_size * 4
    transient = top * vocab_size * (2 + 4) + GRAPH_SLACK_BYTES
    boundaries = sum(buckets) * hidden_size * 2 * 4 * num_segments
    return logits + transient + boundaries


GRAPH_SLACK_BYTES = 512 << 20  # activations of one captured decode forward besides its logits, and workspaces


def layer_segments(num_layers: int, first: int = 2) -> tuple[tuple[int, int], ...]:
    """[start, end) layer ranges of the captured segments, doubling in size from `first` layers: the first
    launch (the only one the device waits for) is short, each later one is hidden behind the previous segment."""
    out, start, size = [], 0, first
    while start < num_layers:
        out.append((start, min(num_layers, start + size)))
        start, size = out[-1][1], size * 2
    return tuple(out)


def is_graphable(plan: StepPlan, max_batch: int, max_pages: int) -> bool:
    """Decode-only (one new token each), every row sampled, no snapshot this step, fits the largest bucket and
    the static page table."""
    return is_launchable(plan, LaunchLimits(max_batch, max_pages))


class DecodeGraphs:
    """Captured decode forwards per bucket; `run(plan)` -> logits [B, vocab] fp32 (a view valid until next run)."""

    def __init__(
        self,
        model: NemotronHForCausalLM,
        pools: StateTensors,
        page_size: int,
        max_pages: int,
        max_num_seqs: int,
        device: torch.device,
    ):
        self.model, self.pools, self.page_size, self.max_pages = model, pools, page_size, max_pages
        self.buckets = graph_buckets(max_num_seqs)
        nb = self.buckets[-1]
        self.device = device
        reserved_before = torch.cuda.memory_reserved(device)
        # static device inputs: small [_FIELDS, nb] (ids, slots, kv slots, prefix lens) and the page table
        self.small = torch.zeros(_FIELDS, nb, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(nb, max_pages, dtype=torch.int64, device=device)
        self.arange = torch.arange(nb + 1, dtype=torch.int64, device=device)  # query_start_loc, logits rows
        # two pinned sets used in turn: a step's host-to-device copy may still be queued while the next step
        # (launched ahead by async scheduling) packs its inputs; the set is reused only after its step's results
        # were waited for, which is after its copies ran
        self.host_small = [torch.zeros(_FIELDS, nb, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.host_table = [torch.zeros(nb * max_pages, dtype=torch.int64).pin_memory() for _ in range(2)]  # [b, w]
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.no_snapshots = SnapshotPlan(empty, empty, empty, empty)
        self.segments = layer_segments(len(model.backbone.layers))
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> one captured graph per segment
        # static logits [max bucket, vocab] fp32, shared by the buckets: bucket b writes rows [:b]
        self.logits = torch.empty(nb, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.num_replays = 0  # decode steps served by a graph
        self.reserved_before = reserved_before  # the allocator's reserved bytes before the static buffers
        self.captured_bytes = 0  # memory the static buffers and the graphs keep (reserved after capture - before)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        """The smallest captured bucket that holds `batch` rows (batch <= max_batch)."""
        return next(x for x in self.buckets if x >= batch)

    def _metas(self, b: int) -> tuple[torch.Tensor, AttentionMeta, MambaMeta]:
        """(input ids, attention and mamba metadata) of bucket b over the static buffers."""
        ids, slots, kv_slots, prefix = self.small[0, :b], self.small[1, :b], self.small[2, :b], self.small[3, :b]
        qsl = self.arange[: b + 1]
        attn = AttentionMeta(
            kv_slots, self.page_table[:b], qsl, prefix, 1, self.max_pages * self.page_size, self.page_size
        )
        return ids, attn, MambaMeta(slots, qsl, self.arange[:b], True, None, self.no_snapshots)

    @torch.inference_mode()
    def _segment(self, b: int, i: int, x: torch.Tensor | None, h: torch.Tensor | None):
        """Segment i of bucket b's decode forward: (x, h) -> (x, h), the first one embeds, the last one returns
        the logits [b, vocab] fp32."""
        ids, attn, mamba = self._metas(b)
        m, p = self.model, self.pools
        start, end = self.segments[i]
        if i == 0:
            x, h = m.embed(ids)
        x, h = m.run_layers(x, h, start, end, attn, mamba, p.kv, p.conv, p.ssm)
        if i < len(self.segments) - 1:
            return x, h
        return m.logits(x, self.arange[:b], out=self.logits[:b])

    def _forward(self, b: int) -> torch.Tensor:
        """The whole decode forward of bucket b, segment after segment (eager)."""
        out = (None, None)
        for i in range(len(self.segments)):
            out = self._segment(b, i, *out)
        return out

    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every bucket, largest first, in one memory pool, one graph
        per layer segment: segment i+1 reads segment i's static outputs, so replaying the segments in order
        equals the whole forward, and the host launches segment i+1 while the device runs segment i (a graph's
        launch costs host time per node, and the device waits for a launch to finish before it starts).
        The static inputs are all zero: scratch slot 0 and page 0 only are touched."""
        mem_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        for b in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            out, graphs = (None, None), []
            for i in range(len(self.segments)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mem_pool, stream=stream):
                    out = self._segment(b, i, *out)  # keeps the segment's outputs alive for the next one
                graphs.append(graph)
            self.graphs[b] = graphs
        torch.cuda.synchronize(self.device)
        self.captured_bytes = torch.cuda.memory_reserved(self.device) - self.reserved_before

    def replay(self, bucket: int) -> torch.Tensor:
        """Replays bucket's segments in order on the current stream; returns its static logits [bucket, vocab]."""
        for graph in self.graphs[bucket]:
            graph.replay()
        return self.logits[:bucket]

    def run(self, plan: StepPlan, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the smallest bucket that holds the step (`is_graphable(plan)` must hold). token_ids: [B] int64
        on the device, the rows' input tokens (None: the rows' token_ids). Only the first w page columns are
        written: attention never reads a page past a request's context, so stale columns are harmless; padding
        rows (context 1) read column 0 = scratch page 0. Never waits for the device."""
        B = len(plan.rows)
        b = self.bucket_for(B)
        w = max(len(s.page_ids) for s in plan.rows)
        host_small, host_table = self.host_small[self.num_replays % 2], self.host_table[self.num_replays % 2]
        table = host_table[: b * w].view(b, w)
        pack_decode_inputs(plan, self.page_size, host_small.numpy()[:, :b], table.numpy(), token_ids is None)
        self.small.copy_(host_small, non_blocking=True)  # whole buffer: one contiguous pinned copy
        self.page_table[:b, :w].copy_(table, non_blocking=True)
        if token_ids is not None:
            self.small[0, :B].copy_(token_ids)
        self.num_replays += 1
        return self.replay(b)[:B]


def pack_decode_inputs(
    plan: StepPlan, page_size: int, small: np.ndarray, table: np.ndarray, with_ids: bool = True
) -> None:
    """Fills the host buffers of a decode-only step of B requests for a bucket of b >= B rows:
    small [_FIELDS, b] (token ids, live slots, KV slot of the new token, prefix lengths), table [b, w] page ids
    (w >= every request's page count). Rows past B (padding) are all zero: scratch slot 0, scratch page 0.
    with_ids=False leaves the token ids zero (they come from the device)."""
    reqs = plan.rows
    B = len(reqs)
    pages = [s.page_ids for s in reqs]
    lens = np.fromiter(map(len, pages), dtype=np.int64, count=B)
    table[:] = 0
    table[:B][np.arange(table.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(pages), dtype=np.int64, count=int(lens.sum())
    )
    prefix = np.fromiter((s.prefix_len for s in reqs), dtype=np.int64, count=B)
    small[:, B:] = 0
    if with_ids:
        small[0, :B] = scheduled_token_ids(plan)
    small[1, :B] = np.fromiter((s.live_slot for s in reqs), dtype=np.int64, count=B)
    small[2, :B] = table[np.arange(B), prefix // page_size] * page_size + prefix % page_size
    small[3, :B] = prefix
