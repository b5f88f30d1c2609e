"""FP8 kernels vs their torch references: the _scaled_mm linear (CPU and Hopper), the Triton weight-only FP8 MoE
(interpreter on CPU, GPU when present), and an FP8 dummy Nano slice through the Triton bundle with CUDA graphs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from service.engine.kernels import fp8
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tests.kernels.triton_test_util import DEVICE, gpu, needs_cuda


def fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g) / k**0.5
    scale = w.abs().max() / FP8_MAX
    return (w / scale).to(FP8_DTYPE), scale.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("T,N,K", [(1, 64, 32), (7, 200, 64), (5, 40, 24), (33, 48, 80)])
def test_scaled_mm_linear_equals_the_w8a8_reference(T, N, K):
    """Shapes _scaled_mm refuses (N=200, K=24 not multiples of 16) are padded; same math as the reference."""
    g = torch.Generator().manual_seed(T * N + K)
    w, ws = fp8_weight(N, K, g)
    x = torch.randn(T, K, generator=g).to(DEVICE, torch.bfloat16)
    xs = (x.float().abs().max() / FP8_MAX).reshape(())
    bias = torch.randn(N, generator=g).to(DEVICE, torch.bfloat16)
    out = fp8.fp8_linear(x, w.to(DEVICE), ws.to(DEVICE), xs, bias)
    ref = fp8.fp8_linear_ref(x, w.to(DEVICE), ws.to(DEVICE), xs, bias)
    assert out.shape == (T, N) and out.dtype == torch.bfloat16
    assert rel(out, ref) < 1e-2
    # the activation quantization is real: the weight-only result differs more than the rounding above
    assert rel(fp8.fp8_linear_dequant_ref(x, w.to(DEVICE), ws.to(DEVICE), xs, bias), ref) > 1e-3


def test_fp8_linear_rejects_bad_scales_and_dtypes():
    w = torch.zeros(16, 16, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="per-tensor scalars"):
        fp8.fp8_linear_ref(torch.zeros(2, 16), w, torch.ones(16), torch.ones(()))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.fp8_linear_ref(torch.zeros(2, 16), w.float(), torch.ones(()), torch.ones(()))


def moe_fp8_inputs(T: int, E: int, k: int, d: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(E, inter, d, generator=g) / d**0.5
    down = torch.randn(E, d, inter, generator=g) / inter**0.5
    up_s = up.abs().amax(dim=(1, 2)) / FP8_MAX  # per-expert scales, all different
    down_s = down.abs().amax(dim=(1, 2)) / FP8_MAX
    up8 = (up / up_s[:, None, None]).to(FP8_DTYPE)
    down8 = (down / down_s[:, None, None]).to(FP8_DTYPE)
    x = torch.randn(T, d, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return [
        t.to(DEVICE) for t in (x.to(dtype), up8, down8, up_s, down_s, torch.tensor(0.05), torch.tensor(0.05), w, ids)
    ]


@pytest.mark.parametrize("T", [1, 5, 40])
def test_triton_fp8_moe_equals_the_weight_only_reference(T):
    from service.engine.kernels.fp8_moe import fp8_moe_experts

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    args = moe_fp8_inputs(T, 8, 2, 64, 32, dtype, seed=T)
    out = fp8_moe_experts(*args)
    ref = fp8.fp8_moe_experts_ref(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert rel(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("T,N,K", [(1, 10304, 2688), (1, 2688, 4096), (256, 3712, 2688), (2048, 2688, 1856)])
def test_scaled_mm_on_hopper_nano_shapes(T, N, K):
    g = torch.Generator().manual_seed(T + N)
    w, ws = fp8_weight(N, K, g)
    x = torch.randn(T, K, generator=g).cuda().bfloat16()
    xs = (x.float().abs().max() / FP8_MAX).reshape(())
    out = fp8.fp8_linear(x, w.cuda(), ws.cuda(), xs)
    assert rel(out, fp8.fp8_linear_ref(x, w.cuda(), ws.cuda(), xs)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_triton_fp8_moe_on_nano_shapes(T):
    from service.engine.kernels.fp8_moe import fp8_moe_experts

    args = moe_fp8_inputs(T, 128, 6, 2688, 1856, torch.bfloat16, seed=T)
    assert rel(fp8_moe_experts(*args), fp8.fp8_moe_experts_ref(*args)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.xfail(
    strict=True,
    reason="W8A8 with the dummy weights' fixed input scale is 0.158 relative from the weight-only torch bundle on the "
    "H200 (bound 0.1): dummy FP8 layers need input scales drawn to match their activations (benchmarks/RESULTS.md)",
)
def test_fp8_dummy_nano_slice_triton_bundle_close_to_torch_bundle(tmp_path):
    """Nano-shaped slice (M M * E), FP8 with the published exclusions, dummy weights (same seed, same weights): the
    Triton bundle (W8A8 _scaled_mm dense GEMMs, weight-only FP8 MoE) gives prefill logits within a few percent of
    the torch bundle (weight-only everywhere), and generates through CUDA graphs with finite logprobs."""
    from service.engine import Engine, EngineConfig, SamplingParams
    from service.engine.model.quant import QuantConfig
    from service.testing.model_dir import fp8_exclusions, published_config
    from tests.engine.helpers import full_prefill_logits

    cfg = published_config("nano")
    cfg.update(hybrid_override_pattern="MM*E", num_hidden_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps(QuantConfig("FP8", None, fp8_exclusions(cfg)).to_hf_quant_config())
    )
    base = dict(
        model_path=str(tmp_path),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_seqs=4,
        max_model_len=256,
        mamba_cache_strategy="off",
    )
    engines = {kb: Engine(EngineConfig(**base, kernel_backend=kb)) for kb in ("torch", "triton")}
    assert engines["triton"].runner.model.backbone.layers[0].mixer.in_proj.weight.dtype == FP8_DTYPE
    ids = list(range(5, 105))
    a, b = (full_prefill_logits(engines[kb], ids) for kb in ("triton", "torch"))
    assert torch.isfinite(a).all() and rel(a, b) < 0.1, rel(a, b)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = engines["triton"].generate([[5 + i for i in range(n)] for n in (3, 40, 100)], params)
    assert engines["triton"].runner.graphs is not None and engines["triton"].runner.graphs.num_replays > 0
    assert all(len(o.token_ids) == 8 and all(map(math.isfinite, o.logprobs)) for o in outs)
