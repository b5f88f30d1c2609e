"""One rank's worker: builds the model and this rank's state tensors and carries out the device work of each
`StepPlan` (slot copies and zeros, the forward, snapshot copies, and on rank 0 sampling)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from service.engine.cache.pools import PoolSizes
from service.engine.config import EngineConfig, ModelConfig
from service.engine.distributed.parallel import ParallelContext, RankShapes
from service.engine.distributed.step import SlotOps, StepPlan, StepRow, sub_plan
from service.engine.kernels import get_kernels
from service.engine.kernels.transfer import to_device_async
from service.engine.model import loader
from service.engine.model.nemotron_h import NemotronHForCausalLM
from service.engine.model.quant import read_quant_config
from service.engine.runner import memory_plan
from service.engine.runner.batch import build_forward_batch
from service.engine.runner.cuda_graph import DecodeGraphs, is_graphable
from service.engine.runner.sampler import DeviceSample, HostSample, Sampler, SamplerOutput
from service.engine.runner.split import StepSplit, restore_batch_order, split_step
from service.engine.runner.state_tensors import StateShapes, StateTensors

log = logging.getLogger("hybrid_serve.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(cfg: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if not cfg.device.startswith("cuda"):
        return torch.float32
    return _DTYPES.get(model_cfg.torch_dtype, torch.bfloat16)


def resolve_kv_dtype(cfg: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: kv_cache_dtype fp8 -> float8_e4m3fn, bf16 -> bfloat16, auto -> float8_e4m3fn
    when the checkpoint's kv_cache_quant_algo is FP8, else the model dtype `dtype`."""
    if cfg.kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    if cfg.kv_cache_dtype == "bf16":
        return torch.bfloat16
    return torch.float8_e4m3fn if read_quant_config(cfg.model_path).kv_cache_quant_algo == "FP8" else dtype


_SSM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_ssm_dtype(cfg: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    """The SSM state dtype: mamba_ssm_cache_dtype, or for auto the checkpoint's own mamba_ssm_cache_dtype (float32
    when it names none: exact states)."""
    name = cfg.mamba_ssm_cache_dtype
    if name == "auto":
        name = model_cfg.mamba_ssm_cache_dtype
        if name not in _SSM_DTYPES:
            raise ValueError(
                f"the checkpoint's config.json asks for mamba_ssm_cache_dtype {name!r}; supported: "
                f"{sorted(_SSM_DTYPES)} (set mamba_ssm_cache_dtype explicitly to override it)"
            )
    return _SSM_DTYPES[name]


def default_pool_sizes(cfg: EngineConfig, max_model_len: int) -> PoolSizes:
    pages_per_seq = math.ceil(min(max_model_len, 2048) / cfg.page_size)
    num_pages = cfg.num_kv_pages or max(2 * cfg.max_num_seqs * pages_per_seq, math.ceil(max_model_len / cfg.page_size))
    snapshots = cfg.max_mamba_snapshots if cfg.max_mamba_snapshots is not None else 2 * cfg.max_num_seqs
    live = cfg.num_mamba_slots or cfg.max_num_seqs
    return PoolSizes(
        num_kv_pages=num_pages + 1,
        num_live_slots=live,
        num_snapshot_slots=snapshots if cfg.mamba_cache_strategy != "off" else 0,
    )


def build_model(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext = ParallelContext(),
) -> NemotronHForCausalLM:
    """This rank's part of the model (the whole model at tp 1), weights read slice by slice."""
    kernels = get_kernels(cfg.resolved().kernel_backend)
    log.info("kernel backend: %s", kernels.name)
    return loader.build_model(cfg, model_cfg, kernels, dtype, device, parallel)


def state_shapes(m: ModelConfig, s: RankShapes) -> StateShapes:
    """The state tensor sizes of one rank: its KV heads, conv channels (x, B, C of its heads and groups), heads."""
    return StateShapes(
        len(m.attention_layer_ids),
        s.kv_heads,
        m.head_dim,
        len(m.mamba_layer_ids),
        s.conv_dim,
        m.conv_kernel,
        s.mamba_heads,
        m.mamba_head_dim,
        m.ssm_state_size,
    )


@dataclass(frozen=True)
class InFlightStep:
    """A step that was launched and whose results are not read yet (async scheduling)."""

    rows: dict[str, int]  # request_id of a sampling row -> its index k in token_ids
    token_ids: torch.Tensor  # [R] int64 sampled tokens on the device (every rank): a carried row's input
    host: HostSample | None  # rank 0: the sampled tokens (and logprobs) on their way to the host (None: R = 0)
    order: tuple[int, ...]  # [R] the plan row (index into plan.rows) that sample k belongs to

    def result(self) -> SamplerOutput:
        """Waits for this step's results only (rank 0); one per sampling row, in batch order."""
        if self.host is None:
            return SamplerOutput([], None, None)
        return in_batch_order(self.host.result(), list(self.order))


def in_batch_order(out: SamplerOutput, rows: list[int]) -> SamplerOutput:
    """out's results (result k belongs to plan row rows[k]) sorted by plan row."""
    return SamplerOutput(
        restore_batch_order(out.token_ids, rows),
        None if out.logprobs is None else restore_batch_order(out.logprobs, rows),
        None if out.top_logprobs is None else restore_batch_order(out.top_logprobs, rows),
    )


class ModelRunner:
    """The worker of one tensor-parallel rank. rank 0 samples; with tp > 1 it shares the sampled tokens of a
    launched step with the other ranks (they feed the next step's inputs on the device)."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        max_model_len: int,
        model: NemotronHForCausalLM | None = None,
        parallel: ParallelContext = ParallelContext(),
    ):
        cfg = cfg.resolved()
        self.cfg, self.model_cfg = cfg, model_cfg
        self.parallel = parallel  # this rank's place in the engine's tp group
        self.rank = parallel.rank
        self.device = torch.device(cfg.device)
        self.dtype = resolve_dtype(cfg, model_cfg)
        self.kv_dtype = resolve_kv_dtype(cfg, self.dtype)
        self.ssm_dtype = resolve_ssm_dtype(cfg, model_cfg)
        if model is not None:  # a prebuilt model runs the configured backend (a bundle of that backend with
            if model.kernels.name != cfg.kernel_backend:  # some ops swapped, e.g. by a benchmark, is kept)
                model.kernels = get_kernels(cfg.kernel_backend)
                model.prepare_weights()
            log.info("kernel backend: %s", model.kernels.name)
        self.model = model if model is not None else build_model(cfg, model_cfg, self.dtype, self.device, parallel)
        # on CUDA without an explicit num_kv_pages the pools fill the memory left (memory_plan.py); else max_num_seqs
        self.memory_plan = None
        if self.device.type == "cuda" and cfg.num_kv_pages is None:
            self.memory_plan = memory_plan.plan_for(
                cfg, model_cfg, self.model, max_model_len, self.dtype, self._new_pools, self.kv_dtype, self.ssm_dtype
            )
            log.info(self.memory_plan.log_line())
        self.pool_sizes = (
            default_pool_sizes(cfg, max_model_len)
            if self.memory_plan is None
            else PoolSizes(
                self.memory_plan.num_kv_pages + 1, self.memory_plan.num_live_slots, self.memory_plan.num_snapshot_slots
            )
        )
        self.pools = self._new_pools(self.pool_sizes)
        self.sampler = Sampler(self.device, cfg.seed) if self.rank == 0 else None
        self.generators: dict[str, torch.Generator] = {}  # request_id -> seeded generator (rank 0)
        self.graphs = self._capture_graphs(max_model_len)
        # split mixed steps: plain decode rows replayed from a graph, the rest eager (tests may set it on CPU)
        self.split_steps = self.graphs is not None
        self.num_split_steps = 0  # steps run as a graph part plus an eager part
        self._last: InFlightStep | None = None  # the last launched step: a carried plan's input tokens

    def _new_pools(self, sizes: PoolSizes) -> StateTensors:
        shapes = state_shapes(self.model_cfg, self.model.shapes)
        return StateTensors(
            sizes, self.cfg.page_size, shapes, self.dtype, self.device, self.kv_dtype, ssm_dtype=self.ssm_dtype
        )

    def _capture_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        """Decode graphs only on CUDA with the triton kernels (the torch reference path reads the device)."""
        cfg = self.cfg
        if not (cfg.cuda_graphs and self.device.type == "cuda" and cfg.kernel_backend == "triton"):
            log.info(
                "cuda graphs: off (cuda_graphs=%s, device=%s, kernel_backend=%s)",
                cfg.cuda_graphs,
                self.device,
                cfg.kernel_backend,
            )
            return None
        graphs = DecodeGraphs(
            self.model,
            self.pools,
            cfg.page_size,
            math.ceil(max_model_len / cfg.page_size) + 1,
            cfg.max_num_seqs,
            self.device,
        )
        graphs.capture()
        plan = self.memory_plan
        reserve = "" if plan is None else f" (the memory plan reserved {plan.graph_bytes / 2**30:.2f} GiB)"
        log.info(
            "cuda graphs: captured decode buckets %s, keeping %.2f GiB%s",
            graphs.buckets,
            graphs.captured_bytes / 2**30,
            reserve,
        )
        return graphs

    def execute(self, plan: StepPlan) -> SamplerOutput | None:
        """Slot work, the forward (plain decode rows replayed from a graph, the rest in one eager forward), and on
        rank 0 the sampling of the rows that reached their end (one sampler call, results in batch order)."""
        self._apply_slot_ops(plan)
        logits, rows = self.forward(plan, self._split(plan))
        if self.rank != 0:
            return None
        if not rows:
            return SamplerOutput([], None, None)
        return in_batch_order(self._sample([plan.rows[i] for i in rows], logits).to_host().result(), rows)

    def launch(self, plan: StepPlan) -> InFlightStep:
        """Enqueues a step as `execute` runs it (slot work, the forward, sampling) and the copy of its results to
        the host, without waiting for them. A carried row's input token is its request's sample in the last
        launched step, read on the device (every rank has it)."""
        self._apply_slot_ops(plan)
        logits, rows = self.forward(plan, self._split(plan))
        if not rows:
            sampled, host = torch.zeros(0, dtype=torch.int64, device=self.device), None
        elif self.rank == 0:
            sample = self._sample([plan.rows[i] for i in rows], logits)
            sampled, host = self._share_tokens(sample.token_ids), sample.to_host()
        else:
            zeros = torch.zeros(len(rows), dtype=torch.int64, device=self.device)
            sampled, host = self._share_tokens(zeros), None
        index = {plan.rows[i].request_id: k for k, i in enumerate(rows)}
        self._last = InFlightStep(index, sampled, host, tuple(rows))
        return self._last

    def _share_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[B] int64: rank 0's sampled tokens on every rank (a sum in which the other ranks add zeros)."""
        return self.parallel.all_reduce(token_ids)

    def apply(self, ops: SlotOps) -> None:
        """Device work between steps: publish copies, then forget finished requests' generators."""
        self._publish(ops.publish_copies)
        for rid in ops.released:
            self.generators.pop(rid, None)

    def _publish(self, copies: tuple[tuple[int, int], ...]) -> None:
        self.pools.copy_slots([s for s, _ in copies], [d for _, d in copies])

    def _apply_slot_ops(self, plan: StepPlan) -> None:
        """The step's publish copies, slot copies (cache hits into fresh live slots) and zero fills, in this order,
        before its forward."""
        self._publish(plan.publish_copies)
        self.pools.copy_slots([s for s, _ in plan.slot_copies], [d for _, d in plan.slot_copies])
        self.pools.zero_slots(list(plan.slot_zeros))

    def _sample(self, rows: list[StepRow], logits: torch.Tensor) -> DeviceSample:
        """Enqueues the sampling of logits [R, vocab], one row per plan row of rows (its params and seed)."""
        gens = [self._generator(r.request_id, r.params.seed) for r in rows]
        return self.sampler.sample(logits, [r.params for r in rows], gens)

    def _input_ids(self, plan: StepPlan) -> torch.Tensor | None:
        """[T] int64 on the device: the plan's tokens, request-major, a carried row's token read from the last
        launched step's samples; None when no row is carried (the rows' token_ids are the inputs)."""
        if not plan.carried:
            return None
        last = self._last
        src = [last.rows[r.request_id] for r in plan.rows if r.carried]
        if len(src) == len(plan.rows):  # decode rows only
            if src == list(range(len(last.order))):
                return last.token_ids
            return last.token_ids.index_select(0, to_device_async(src, torch.int64, self.device))
        flat, dst = [], []
        for r in plan.rows:
            if r.carried:
                dst.append(len(flat))
            flat.extend(r.token_ids or (0,))  # a carried row's place, filled on the device
        ids = to_device_async(flat, torch.int64, self.device)
        picked = last.token_ids.index_select(0, to_device_async(src, torch.int64, self.device))
        return ids.index_copy_(0, to_device_async(dst, torch.int64, self.device), picked)

    def _split(self, plan: StepPlan) -> StepSplit | None:
        """How to run the step: None = one eager forward (no graphs, or no plain decode row)."""
        if not self.split_steps:
            return None
        g = self.graphs
        split = split_step(plan, g.max_batch if g else self.cfg.max_num_seqs, g.max_pages if g else 1 << 62)
        if not split.graph_rows:
            return None
        self.num_split_steps += bool(split.eager_rows)
        return split

    def forward(self, plan: StepPlan, split: StepSplit | None) -> tuple[torch.Tensor, list[int]]:
        """Runs the step (slot work already applied). Returns logits [R, vocab] fp32 and, for each of its R rows,
        the index into plan.rows of the request it samples for. With a split, the graph rows run first
        (replayed, or one eager forward of their own without graphs), then the eager rows; without one, one eager
        forward of everything."""
        parts: list[tuple[torch.Tensor, list[int]]] = []
        if split is not None and split.graph_rows:
            sub = sub_plan(plan, split.graph_rows)
            g = self.graphs
            logits = g.run(sub, self._input_ids(sub)) if g is not None else self._run_one(sub)[0]
            parts.append((logits, list(split.graph_rows)))
        eager_rows = split.eager_rows if split is not None else tuple(range(len(plan.rows)))
        if eager_rows:
            # a split's eager part never replays: it would overwrite the graph part's static logits
            logits, sample_rows = self._run_one(sub_plan(plan, eager_rows), may_replay=split is None)
            parts.append((logits, [eager_rows[i] for i in sample_rows]))
        parts = [p for p in parts if p[1]]
        if not parts:
            return torch.empty(0, device=self.device), []
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), parts[0][1] + parts[1][1]

    def _run_one(self, plan: StepPlan, may_replay: bool = True) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One forward (a graph replay if allowed and the whole step is a plain decode step, else eager):
        logits [R, vocab] and the R sampled rows (indices into plan.rows)."""
        ids = self._input_ids(plan)
        if may_replay and self.graphs is not None and is_graphable(plan, self.graphs.max_batch, self.graphs.max_pages):
            return self.graphs.run(plan, ids), tuple(range(len(plan.rows)))
        return self._eager(plan, ids)

    def _eager(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One eager forward of the step: logits [R, vocab] and the R sampled rows. input_ids: [T] on the device
        when some tokens are not on the host (None: the rows' token_ids)."""
        batch = build_forward_batch(
            plan,
            self.cfg.page_size,
            self.model_cfg.chunk_size,
            self.device,
            input_ids,
            split_mamba=self.model.kernels.mamba_decode_split,
        )
        logits = self.model(
            batch.input_ids,
            batch.attn,
            batch.mamba,
            batch.logits_indices,
            self.pools.kv,
            self.pools.conv,
            self.pools.ssm,
        )
        return logits, batch.sample_rows

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self.generators[request_id] = g
        return self.generators[request_id]
