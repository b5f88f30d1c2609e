"""Projections through the kernel bundle, and the tensor-parallel linears with their weight loaders.

Every parameter may carry a `weight_loader(dst, src, part)` (set by `set_loader`): it copies this rank's slice of
the checkpoint tensor `src` (a lazy `Source`: only the sliced bytes are read) into `dst`, the parameter's data.
`part` is None when the checkpoint tensor is the whole parameter (every segment, concatenated) and i when it is
segment i alone (attention's q_proj / k_proj / v_proj are parts 0 / 1 / 2 of the fused qkv_proj; expert j of
stacked experts). A parameter without a loader is replicated (`full_loader`).

- `ColumnParallelLinear`: output rows split, segment by segment (`Segment`: this rank's rows of one part).
- `RowParallelLinear`: input columns split; the output is this rank's partial sum (the layer all-reduces once);
  its bias lives on rank 0 only (zeros elsewhere) so the sum counts it once.
- `ReplicatedLinear`: whole weight on every rank; `partial_input` (a linear applied to each rank's partial sum,
  the latent MoE's fc2) keeps the bias on rank 0 only, as above.
At tp 1 all of them are plain `nn.Linear`s holding the whole weight."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from service.engine.kernels import Kernels

_FP8 = torch.float8_e4m3fn


def is_fp8_linear(layer: nn.Module) -> bool:
    """An FP8 checkpoint's linear (model/quant.py): weight float8_e4m3fn, with `weight_scale` and `input_scale`."""
    return layer.weight.dtype == _FP8


def project(k: Kernels, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) computed by `k.linear` (the Triton bundle picks its GEMV or cuBLAS by shape), or by `k.fp8_linear`
    for an FP8 layer."""
    if layer.weight.dtype == _FP8:
        return k.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
    return k.linear(x, layer.weight, layer.bias)


def add_norm_project(
    k: Kernels, layer: nn.Linear, out: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(RMSNorm(residual + out) * norm_weight), residual + out): `k.add_rms_norm_linear` (one launch at batch 1
    on the Triton bundle), or for an FP8 layer `k.add_rms_norm` then `k.fp8_linear`."""
    if layer.weight.dtype == _FP8:
        x, h = k.add_rms_norm(out, residual, norm_weight, eps)
        return project(k, layer, x), h
    return k.add_rms_norm_linear(out, residual, norm_weight, eps, layer.weight, layer.bias)


def gated_norm_project(
    k: Kernels,
    layer: nn.Linear,
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """layer(gated group RMSNorm(y, z)): `k.gated_norm_linear`, or for an FP8 layer `k.gated_rms_norm` (to z's
    dtype) then `k.fp8_linear`."""
    if layer.weight.dtype == _FP8:
        return project(k, layer, k.gated_rms_norm(y, z, norm_weight, group_size, eps, z.dtype))
    return k.gated_norm_linear(y, z, norm_weight, group_size, eps, layer.weight, layer.bias)


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor, not read yet."""

    name: str  # its checkpoint name (error messages)
    shape: tuple[int, ...]  # its full shape
    read: Callable[[tuple[slice, ...]], torch.Tensor]  # the part at one slice per dim (reads only that part)

    @classmethod
    def of_tensor(cls, name: str, t: torch.Tensor) -> Source:
        """An in-memory tensor as a source (tests, models built in memory)."""
        return cls(name, tuple(t.shape), lambda index: t[index])

    def read_all(self) -> torch.Tensor:
        return self.read(tuple(slice(None) for _ in self.shape))


WeightLoader = Callable[[torch.Tensor, Source, "int | None"], None]


@dataclass(frozen=True)
class Segment:
    """This rank's part of one segment of a split axis: rows [start, start + size) of the segment's `full` rows."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, n: int) -> Segment:
        return cls(n, 0, n)


def set_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader


def get_loader(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", full_loader)


def _mismatch(src: Source, expected: tuple[int, ...]) -> ValueError:
    return ValueError(f"tensor {src.name!r} has shape {src.shape}, the model expects {expected}")


def copy_into(dst: torch.Tensor, t: torch.Tensor, src: Source) -> None:
    if tuple(dst.shape) != tuple(t.shape):
        raise _mismatch(src, tuple(dst.shape))
    if (dst.dtype == _FP8) != (t.dtype == _FP8):
        raise ValueError(
            f"tensor {src.name!r} is {t.dtype}, the model expects {dst.dtype} (from the checkpoint's "
            "quantization config: check quant_algo and exclude_modules)"
        )
    dst.copy_(t.to(dtype=dst.dtype))


def full_loader(dst: torch.Tensor, src: Source, part: int | None) -> None:
    """Replicated parameter: the whole tensor."""
    if src.shape != tuple(dst.shape):
        raise _mismatch(src, tuple(dst.shape))
    copy_into(dst, src.read_all(), src)


def segment_loader(dim: int, segments: tuple[Segment, ...]) -> WeightLoader:
    """Loader of a parameter split along `dim` into `segments` (this rank's rows of each, concatenated)."""

    def load(dst: torch.Tensor, src: Source, part: int | None) -> None:
        chosen = range(len(segments)) if part is None else (part,)
        expected = list(dst.shape)
        expected[dim] = sum(segments[i].full for i in chosen)
        if list(src.shape) != expected:
            raise _mismatch(src, tuple(expected))
        src_off, dst_off = 0, 0
        for i, seg in enumerate(segments):
            if i in chosen:
                index = [slice(None)] * dst.dim()
                index[dim] = slice(src_off + seg.start, src_off + seg.start + seg.size)
                copy_into(dst.narrow(dim, dst_off, seg.size), src.read(tuple(index)), src)
                src_off += seg.full
            dst_off += seg.size

    return load


def rank0_loader(rank: int) -> WeightLoader:
    """A term added to a partial sum (row-parallel bias): rank 0 holds it, the other ranks hold zeros."""

    def load(dst: torch.Tensor, src: Source, part: int | None) -> None:
        if rank == 0:
            full_loader(dst, src, part)
        elif src.shape != tuple(dst.shape):
            raise _mismatch(src, tuple(dst.shape))
        else:
            dst.zero_()

    return load


class ColumnParallelLinear(nn.Linear):
    """y_local = x @ W_local^T: this rank's rows of each output segment (weight [sum of sizes, in_features])."""

    def __init__(self, in_features: int, segments: tuple[Segment, ...], bias: bool):
        super().__init__(in_features, sum(s.size for s in segments), bias=bias)
        self.segments = segments
        set_loader(self.weight, segment_loader(0, segments))
        if bias:
            set_loader(self.bias, segment_loader(0, segments))

    def local_rows(self, part: int) -> slice:
        """Rows of this rank's weight that hold segment `part`."""
        start = sum(s.size for s in self.segments[:part])
        return slice(start, start + self.segments[part].size)


class RowParallelLinear(nn.Linear):
    """Partial y = x_local @ W[:, local columns]^T (+ bias on rank 0); the sum over ranks is the full output."""

    def __init__(self, segment: Segment, out_features: int, bias: bool, rank: int):
        super().__init__(segment.size, out_features, bias=bias)
        set_loader(self.weight, segment_loader(1, (segment,)))
        if bias:
            set_loader(self.bias, rank0_loader(rank))


class ReplicatedLinear(nn.Linear):
    """The whole linear on every rank. partial_input: the input is each rank's partial sum, so the bias is held by
    rank 0 only (the sum of the outputs then counts it once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, partial_input: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        if bias and partial_input:
            set_loader(self.bias, rank0_loader(rank))
