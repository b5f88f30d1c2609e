"""Tensor / expert parallelism inside one engine replica: the rank's place, its collectives, and its shapes.

`ParallelContext` says which rank of how many this process is and holds the process group; layers call its
`all_reduce` / `all_gather` (no-ops at tp 1). `check_shardable` refuses configs that cannot be split.
`rank_shapes` gives the per-rank view of `ModelConfig` (heads, groups, experts, vocab this rank holds, and where its
slice starts in the whole model) that the layers build their parameters from and the pools are sized from.

Sharding rules (docs/design.md: Tensor and expert parallelism): attention heads split (KV heads replicated when
tp > num_key_value_heads); Mamba heads split, groups split (n_groups % tp == 0) or each group replicated on the ranks
holding its heads (tp % n_groups == 0); experts either intermediate-split (ep == 1) or spread whole (ep == tp); dense
MLP and shared expert intermediate-split; vocabulary split into tp equal (padded) parts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from service.engine.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig

MAX_TP = 64  # largest tp the "sizes that would work" hint lists


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the replica's tensor-parallel group."""

    tp: int = 1  # ranks (GPUs) in the replica
    ep: int = 1  # 1: experts intermediate-split over the tp ranks; == tp: whole experts spread
    rank: int = 0  # this process's rank in [0, tp)
    group: object | None = None  # torch.distributed ProcessGroup over the tp ranks; None at tp 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep must be 1 or equal to tp ({self.tp}), got ep={self.ep}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank must be in [0, tp={self.tp}), got {self.rank}")

    def _need_group(self) -> None:
        if self.group is None:
            raise ValueError(
                f"ParallelContext(tp={self.tp}, rank={self.rank}) has no process group; "
                "collectives at tp > 1 need one (torch.distributed.new_group over the tp ranks)"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the tp ranks in place and returns it (x itself at tp 1)."""
        if self.tp == 1:
            return x
        self._need_group()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation of every rank's x along dim, in rank order (x itself at tp 1). x: same shape on all ranks.
        gloo has no all-gather of CUDA tensors: there (two ranks sharing a GPU in tests) each rank places x in a
        zero buffer at its own index and the buffers are all-reduced (sums with zeros are exact)."""
        if self.tp == 1:
            return x
        self._need_group()
        x = x.contiguous()
        if x.is_cuda and dist.get_backend(self.group) == "gloo":
            buf = torch.zeros((self.tp, *x.shape), dtype=x.dtype, device=x.device)
            buf[self.rank] = x
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            parts = list(buf.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.tp)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def _problems(c: ModelConfig, tp: int, ep: int) -> list[str]:
    """Why `c` cannot be split over tp ranks with this ep (empty: it can)."""
    out: list[str] = []
    if tp < 1 or ep not in (1, tp):
        return [f"ep must be 1 or equal to tp (got tp={tp}, ep={ep})"]
    types = set(c.layer_types)

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    if ATTENTION in types:
        need(
            c.num_attention_heads % tp == 0,
            f"num_attention_heads ({c.num_attention_heads}) is not divisible by tp ({tp})",
        )
        kv = c.num_key_value_heads
        need(
            kv % tp == 0 or tp % kv == 0,
            f"num_key_value_heads ({kv}) and tp ({tp}): neither divides the other (KV heads are split or replicated)",
        )
    if MAMBA in types:
        need(c.mamba_num_heads % tp == 0, f"mamba_num_heads ({c.mamba_num_heads}) is not divisible by tp ({tp})")
        need(
            c.n_groups % tp == 0 or tp % c.n_groups == 0,
            f"n_groups ({c.n_groups}) and tp ({tp}): neither divides the other (groups are split or replicated)",
        )
    if MOE in types:
        if ep == 1:
            need(
                c.moe_intermediate_size % tp == 0,
                f"moe_intermediate_size ({c.moe_intermediate_size}) is not divisible by tp ({tp}) "
                "(experts are split at ep=1)",
            )
        else:
            need(c.n_routed_experts % ep == 0, f"n_routed_experts ({c.n_routed_experts}) is not divisible by ep ({ep})")
        need(
            c.moe_shared_expert_intermediate_size % tp == 0,
            f"moe_shared_expert_intermediate_size ({c.moe_shared_expert_intermediate_size}) is not divisible by "
            f"tp ({tp})",
        )
    if MLP in types:
        need(c.intermediate_size % tp == 0, f"intermediate_size ({c.intermediate_size}) is not divisible by tp ({tp})")
    return out


def working_sizes(c: ModelConfig) -> list[tuple[int, int]]:
    """The (tp, ep) pairs, tp <= MAX_TP, that `c` can be split over."""
    return [(tp, ep) for tp in range(1, MAX_TP + 1) for ep in sorted({1, tp}) if not _problems(c, tp, ep)]


def check_shardable(c: ModelConfig, tp: int, ep: int) -> None:
    """Raises ValueError naming every size that does not divide, and the (tp, ep) that would work."""
    problems = _problems(c, tp, ep)
    if not problems:
        return
    ok = working_sizes(c)
    tps_ep1 = [t for t, e in ok if e == 1]
    tps_ep_tp = [t for t, e in ok if e == t and t > 1]
    raise ValueError(
        f"the model cannot be split over tp={tp}, ep={ep}: {'; '.join(problems)}. "
        f"Sizes that work: tp in {tps_ep1} with ep=1, or ep=tp in {tps_ep_tp}"
    )


@dataclass(frozen=True)
class RankShapes:
    """What one rank holds of the model; counts are per rank, `*_start` index the whole model's axis."""

    tp: int
    ep: int
    rank: int
    attention_heads: int  # query heads on this rank (= num_attention_heads / tp); first = rank * this
    kv_heads: int  # KV heads on this rank (1 when replicated: tp >= num_key_value_heads)
    kv_head_start: int  # this rank's first KV head in the model
    mamba_heads: int  # Mamba heads on this rank (= mamba_num_heads / tp); first = rank * this
    mamba_groups: int  # B/C groups on this rank (1 when replicated: tp >= n_groups)
    mamba_group_start: int  # this rank's first group in the model
    n_groups: int  # B/C groups of the whole model
    experts: int  # routed experts held (E at ep 1, E / ep at ep == tp)
    expert_start: int  # first held expert (0 at ep 1)
    moe_intermediate: int  # per held expert: its intermediate rows here (I / tp at ep 1, I at ep == tp)
    moe_intermediate_start: int  # first of those rows in the expert (rank * moe_intermediate at ep 1, else 0)
    shared_intermediate: int  # shared expert intermediate rows (moe_shared_expert_intermediate_size / tp)
    intermediate: int  # dense MLP ('-') intermediate rows (intermediate_size / tp)
    vocab: int  # embedding / lm_head rows (ceil(vocab_size / tp); the last rank's tail is padding)
    mamba_head_dim: int  # P (unsplit)
    ssm_state_size: int  # N (unsplit)

    @property
    def attention_head_start(self) -> int:
        return self.rank * self.attention_heads

    @property
    def mamba_head_start(self) -> int:
        return self.rank * self.mamba_heads

    @property
    def mamba_intermediate(self) -> int:  # local Di = local heads * P
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:  # conv state channels: local x + local B + local C
        return self.mamba_intermediate + 2 * self.mamba_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:  # local z + x + B + C + dt
        return self.mamba_intermediate + self.conv_dim + self.mamba_heads

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    @property
    def group_ranks(self) -> int:
        """Ranks that hold each B/C group: 1 when groups are split, tp / n_groups when replicated (the gated norm,
        whose groups are the model's groups, then sums its squares over those ranks)."""
        return max(1, self.tp // self.n_groups)


def rank_shapes(c: ModelConfig, parallel: ParallelContext) -> RankShapes:
    """The per-rank view of `c` (raises ValueError when `c` cannot be split over parallel.tp / parallel.ep)."""
    tp, ep, r = parallel.tp, parallel.ep, parallel.rank
    check_shardable(c, tp, ep)
    kv_heads, kv_start = _split_or_replicate(c.num_key_value_heads, tp, r)
    groups, group_start = _split_or_replicate(c.n_groups, tp, r)
    experts = c.n_routed_experts // ep
    moe_i = c.moe_intermediate_size // tp if ep == 1 else c.moe_intermediate_size
    return RankShapes(
        tp=tp,
        ep=ep,
        rank=r,
        attention_heads=c.num_attention_heads // tp,
        kv_heads=kv_heads,
        kv_head_start=kv_start,
        mamba_heads=c.mamba_num_heads // tp,
        mamba_groups=groups,
        mamba_group_start=group_start,
        n_groups=c.n_groups,
        experts=experts,
        expert_start=r * experts if ep > 1 else 0,
        moe_intermediate=moe_i,
        moe_intermediate_start=r * moe_i if ep == 1 else 0,
        shared_intermediate=c.moe_shared_expert_intermediate_size // tp,
        intermediate=c.intermediate_size // tp,
        vocab=-(-c.vocab_size // tp),
        mamba_head_dim=c.mamba_head_dim,
        ssm_state_size=c.ssm_state_size,
    )


def _split_or_replicate(n: int, tp: int, rank: int) -> tuple[int, int]:
    """(count, first) of n items on `rank`: n / tp each when tp divides n, else one item shared by tp / n ranks.
    Neither divides only for a layer type the model does not have (checked by `check_shardable`): all n."""
    if n % tp == 0:
        return n // tp, rank * (n // tp)
    if tp % n == 0:
        return 1, rank // (tp // n)
    return n, 0
