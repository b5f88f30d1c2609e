"""Fused ops that cut launches per decode step: residual add + RMSNorm, ReLU², and the decode launch count."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.kernels import moe, norm
from service.engine.kernels.triton_activation import relu2
from service.engine.kernels.triton_norm import add_rms_norm
from service.testing.tiny import make_tiny_model
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, needs_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Triton's CPU interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even, like torch), so bf16
# outputs are bit-checked on the GPU only and checked to one bf16 ulp in the interpreter
BF16_TRUNCATED = DEVICE == "cpu"


def _assert_same_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16 and BF16_TRUNCATED:
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert ((out.float() - ref.float()).abs() <= ulp).all()
    else:
        assert torch.equal(out, ref)


def _check_add_rms_norm(shape, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    h = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)  # the residual stream
    out = torch.randn(*shape[:-1], d + 5, generator=g).to(DEVICE, dtype)
    out = out[..., 2 : 2 + d] if strided else out[..., :d].contiguous()  # the mixer's output
    w = torch.randn(d, generator=g).to(DEVICE, dtype)
    h_before, out_before = h.clone(), out.clone()
    normed, new_h = add_rms_norm(out, h, w, 1e-5)
    ref_normed, ref_h = norm.add_rms_norm_ref(out, h, w, 1e-5)
    assert normed.dtype == new_h.dtype == dtype and normed.shape == new_h.shape == h.shape
    _assert_same_rounding(new_h, h + out)  # bit-equal to the forward's former `h = h + out`
    assert torch.equal(ref_h, h + out)
    assert torch.equal(ref_normed, norm.rms_norm_ref(h + out, w, 1e-5))
    assert_close(normed, ref_normed, dtype, "add_rms_norm")
    assert torch.equal(h, h_before) and torch.equal(out, out_before)  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 64), (1, 2688), (3, 1000)])
def test_add_rms_norm_matches_ref(shape, dtype):
    _check_add_rms_norm(shape, dtype, seed=len(shape) + shape[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_strided_rows_and_empty(dtype):
    _check_add_rms_norm((5, 48), dtype, seed=1, strided=True)
    e = torch.zeros(0, 48, device=DEVICE, dtype=dtype)
    normed, new_h = add_rms_norm(e, e, torch.ones(48, device=DEVICE, dtype=dtype), 1e-5)
    assert normed.shape == new_h.shape == (0, 48)


def test_add_rms_norm_rejects_bad_args():
    h = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="x"):
        add_rms_norm(h[:, :16], h, torch.ones(32, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(h, h, torch.ones(16, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        add_rms_norm(h.half(), h, torch.ones(32, device=DEVICE), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 40), (1, 2500), (0, 7), (2, 3, 5)])
def test_relu2_equals_ref_exactly(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 4).to(DEVICE, dtype)
    if x.numel():
        x.view(-1)[0] = 0.0
        x.view(-1)[-1] = -0.0
    out = relu2(x)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_same_rounding(out, moe.relu2(x))


def test_relu2_keeps_nan_and_rejects_strided():
    x = torch.tensor([float("nan"), -1.0, 2.0], device=DEVICE)
    assert torch.equal(relu2(x).isnan(), moe.relu2(x).isnan())
    with pytest.raises(ValueError, match="contiguous"):
        relu2(torch.randn(4, 6, device=DEVICE)[:, :3])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_and_relu2_gpu_nano_shapes(dtype):
    for T in (1, 64, 777):
        _check_add_rms_norm((T, 2688), dtype, seed=T)
        x = torch.randn(T, 3712, device=DEVICE).to(dtype)  # shared expert intermediate
        assert torch.equal(relu2(x), moe.relu2(x))


# ---------------- launches of one decode-only forward (tiny model, triton bundle) ----------------
# ops the fused kernels took over: residual add (add_rms_norm), dt softplus / clamp / -exp(A_log) (decode SSU),
# relu + square (relu2); none may run as a torch op of its own in a decode forward any more
REMOVED_OPS = ("softplus", "clamp", "exp", "neg", "relu", "square", "pow")
NOT_KERNELS = ("empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "lift_fresh")


class _AtenCounter(TorchDispatchMode):
    """Counts the aten ops that launch work (views and allocations left out) while `on` and outside `Kernels` ops
    (inside them the interpreter's own copies would count)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.on = False
        self.in_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.on and not self.in_op and not func.is_view and name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count_decode_forward(path: str) -> tuple[collections.Counter, collections.Counter]:
    """(aten ops outside Kernels ops, Kernels op calls) of the last decode-only forward of a short greedy run."""
    engine = Engine(
        EngineConfig(
            model_path=path,
            device=DEVICE,
            dtype="float32",
            mamba_cache_strategy="off",
            page_size=4,
            max_num_seqs=4,
            kernel_backend="triton",
            cuda_graphs=False,
        )
    )  # eager: the hooks see the forward
    model = engine.runner.model
    counter, calls, seen = _AtenCounter(), collections.Counter(), []

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += counter.on
            counter.in_op += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.in_op -= 1

        return call

    k = model.kernels
    model.kernels = dataclasses.replace(
        k,
        **{f.name: counted(f.name, getattr(k, f.name)) for f in dataclasses.fields(k) if callable(getattr(k, f.name))},
    )

    def pre(mod, args):
        counter.ops.clear()
        calls.clear()
        counter.on = bool(args[2].decode_only)

    def post(mod, args, out):
        if counter.on:
            seen.append((collections.Counter(counter.ops), collections.Counter(calls)))
        counter.on = False

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    with counter:
        # two tokens: one prefill forward, then the one decode-only forward counted
        engine.generate([[5, 6, 7, 8, 9], [11, 12, 13]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(seen) == 1, f"{len(seen)} decode-only forwards ran, expected one"
    return seen[-1]


def test_decode_forward_uses_fused_ops(tmp_path):
    """One rms_norm, then one add_rms_norm per layer (the last fused with norm_f), except before a mamba layer
    other than the first: add_rms_norm_linear (fused with its in_proj; at this batch of 2 still two launches); the
    gated norm + out_proj is one op; the mamba decode step takes the raw dt; ReLU² is one op; the MoE shared expert
    is part of the routed-experts op; the layers run none of the torch ops these replaced. CPU, tiny model,
    counting every aten op and every Triton launch: 166 launches per decode forward before the fusions, 134 after
    (batch 2; at batch 1 the norm + linear fusions save 7 more)."""
    path = make_tiny_model(str(tmp_path / "tiny"), seed=3)
    ops, calls = _count_decode_forward(path)
    layers = "M*MEM-M*E"  # the tiny model's pattern
    later_mamba = layers[1:].count("M")
    assert calls["rms_norm"] == 1 and calls["add_rms_norm"] == len(layers) - later_mamba
    assert calls["add_rms_norm_linear"] == later_mamba and calls["gated_norm_linear"] == layers.count("M")
    assert calls["selective_state_update_slots_raw_dt"] == layers.count("M")
    assert calls["relu2"] == layers.count("-")  # the MoE shared expert runs inside moe_experts
    assert calls["moe_experts"] == layers.count("E")
    assert not [op for op in REMOVED_OPS if ops[op]], dict(ops)
    print(
        f"decode forward: {sum(ops.values())} torch ops outside Kernels ops {dict(ops)}; "
        f"{sum(calls.values())} Kernels calls {dict(calls)}"
    )
