"""Where a decode step's time goes: device time per kernel family and the device's idle time (host gaps) over a
profiled run of engine steps, next to the step's bound (weights + tensor-core work + state and KV traffic).

`split_trace` reads a torch.profiler Chrome trace (kernels, device copies and fills, and the "engine.step"
record_function ranges around each step); `decode_bound` computes the bound of one decode step at batch B from the
model's parameters, its state sizes and the measured ceilings of `roofline.py`. `engine_bench.py --step-split`
prints both for every decode batch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# family -> name patterns (regular expressions, searched in the kernel name, first family that matches wins)
FAMILIES: tuple[tuple[str, str], ...] = (
    ("moe", r"moe|expert|_up_kernel|_down_kernel|_align_kernel|sum_slots|route"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|matmul|scaled_mm|_mm_|sm90_|sm80_"),
    ("attention", r"_decode_kernel|_combine_kernel|_prefill_kernel|attn|attention|write_kv|flash"),
    ("ssu", r"_ssu_kernel|state_update"),
    ("ssd", r"_chunk_cumsum|_chunk_state|_state_passing|_chunk_scan"),
    ("conv", r"_conv_update|_conv_varlen|conv1d|conv_windows"),
    ("norm", r"norm"),
    ("copy", r"memcpy|memset|copy|fill|index|gather|scatter"),
)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_RANGE = "engine.step"  # the record_function name around each profiled step


def family(name: str) -> str:
    """The family of a kernel (or device copy / fill) name; "other" when no pattern matches."""
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass(frozen=True)
class StepSplit:
    steps: int  # engine steps in the window (profiled ranges - 1)
    wall_ms: float  # host wall time per step (first step's end to last step's end, / steps)
    busy_ms: float  # device busy per step (union of its kernels, copies and fills inside the window)
    family_ms: dict[str, float]  # device time per step of each family (kernel durations summed)
    kernels_per_step: float  # device launches (kernels, copies, fills) per step

    @property
    def idle_ms(self) -> float:
        """Device idle per step inside the steps' window: the host gaps."""
        return max(self.wall_ms - self.busy_ms, 0.0)


def split_trace(trace: dict) -> StepSplit:
    """The split of a Chrome trace (`torch.profiler.profile(...).export_chrome_trace`) holding two or more
    STEP_RANGE ranges: the window runs from the end of the first range to the end of the last, n - 1 steps. Each
    `engine.step()` returns when a step's results are on the host, so the interval between two returns is one step
    even under async scheduling; from the first range's start instead, the window would also hold the device work
    of the step launched before profiling began (done or not by then), and the split came out ~20 % short at
    large batches. Device events outside the window are left out."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    # the CPU range only: the profiler also mirrors each record_function range on the GPU timeline
    # (cat "gpu_user_annotation"), which would count every step twice
    steps = [e for e in events if e.get("name") == STEP_RANGE and e.get("cat") != "gpu_user_annotation"]
    if len(steps) < 2:
        raise ValueError(
            f"the trace has {len(steps)} {STEP_RANGE!r} ranges: profile two or more steps inside record_function"
        )
    ends = sorted(float(e["ts"]) + float(e["dur"]) for e in steps)
    lo, hi = ends[0], ends[-1]
    fam: dict[str, float] = {}
    spans: list[tuple[float, float]] = []
    for e in events:
        if e.get("cat") not in DEVICE_CATS:
            continue
        a = max(float(e["ts"]), lo)
        b = min(float(e["ts"]) + float(e["dur"]), hi)
        if b <= a:
            continue
        spans.append((a, b))
        f = family(e["name"])
        fam[f] = fam.get(f, 0.0) + (b - a)
    n = len(steps) - 1
    return StepSplit(
        n,
        (hi - lo) / n / 1e3,
        _union_us(spans) / n / 1e3,
        {k: v / n / 1e3 for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
        len(spans) / n,
    )


def split_trace_file(path: str) -> StepSplit:
    with open(path, encoding="utf-8") as f:
        return split_trace(json.load(f))


@dataclass(frozen=True)
class StepBound:
    """The floor of one decode step at batch B (milliseconds) and what it is made of."""

    batch: int
    weight_bytes: float  # weights read: every non-expert weight but the embedding table, the experts the batch hits
    state_bytes: float  # Mamba conv + SSM states read and written
    kv_bytes: float  # KV read (context tokens of every request) and written (one token each)
    flops: float  # 2 * active parameters per token * B
    bandwidth_gbs: float  # measured (roofline.py)
    peak_tflops: float  # measured bf16 matmul (roofline.py)

    @property
    def memory_ms(self) -> float:
        return (self.weight_bytes + self.state_bytes + self.kv_bytes) / self.bandwidth_gbs / 1e6

    @property
    def compute_ms(self) -> float:
        return self.flops / self.peak_tflops / 1e9

    @property
    def sum_ms(self) -> float:
        """Bytes and tensor-core work one after the other (no overlap): the bound the issue names."""
        return self.memory_ms + self.compute_ms

    @property
    def max_ms(self) -> float:
        """Bytes and tensor-core work fully overlapped: no version runs faster."""
        return max(self.memory_ms, self.compute_ms)


def experts_hit(batch: int, top_k: int, num_experts: int) -> float:
    """Expected share of the experts that a batch of independent tokens routes to (uniform routing)."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def decode_bound(
    batch: int,
    dense_bytes: float,
    expert_bytes: float,
    elem_bytes: float,
    top_k: int,
    num_experts: int,
    slot_bytes: float,
    kv_token_bytes: float,
    context: int,
    bandwidth_gbs: float,
    peak_tflops: float,
) -> StepBound:
    """dense_bytes: weights every token reads (all but experts and the embedding table); expert_bytes: all routed
    experts; elem_bytes: bytes per weight element (flops = 2 per weight element per token); slot_bytes: one
    request's Mamba state over all layers; kv_token_bytes: one token's K and V over all attention layers; context:
    tokens in each request's context."""
    weights = dense_bytes + expert_bytes * experts_hit(batch, top_k, num_experts)
    active_elems = (dense_bytes + expert_bytes * top_k / num_experts) / elem_bytes
    return StepBound(
        batch,
        weights,
        2.0 * batch * slot_bytes,
        batch * (context + 1) * kv_token_bytes,
        2.0 * active_elems * batch,
        bandwidth_gbs,
        peak_tflops,
    )


def split_lines(split: StepSplit, bound: StepBound | None) -> list[str]:
    """Markdown lines: the step's split and, when given, its bound."""
    fams = ", ".join(f"{k} {v:.2f}" for k, v in split.family_ms.items())
    lines = [
        f"- decode B={bound.batch if bound else '?'}: {split.wall_ms:.2f} ms per step (host wall, {split.steps} steps), "
        f"device busy {split.busy_ms:.2f}, host gaps {split.idle_ms:.2f}, {split.kernels_per_step:.0f} launches; "
        f"device ms per family: {fams}"
    ]
    if bound is not None:
        lines.append(
            f"  bound: weights {bound.weight_bytes / 1e9:.1f} GB + states {bound.state_bytes / 1e9:.1f} GB + KV "
            f"{bound.kv_bytes / 1e9:.2f} GB at {bound.bandwidth_gbs:.0f} GB/s = {bound.memory_ms:.2f} ms; "
            f"tensor cores {bound.flops / 1e12:.1f} TFLOP at {bound.peak_tflops:.0f} TFLOP/s = {bound.compute_ms:.2f} ms; "
            f"sum {bound.sum_ms:.2f} ms (step at {100 * bound.sum_ms / split.wall_ms:.0f} % of it), "
            f"max {bound.max_ms:.2f} ms"
        )
    return lines
