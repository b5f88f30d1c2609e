"""FP8 kernels vs their torch references: the _scaled_mm linear (CPU and Hopper), and an FP8 dummy Nano slice through
the Triton bundle with CUDA graphs. The Triton FP8 kernels themselves: test_triton_fp8.py."""

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
def test_fp8_dummy_nano_slice_triton_bundle_close_to_torch_bundle(tmp_path):
    """Nano-shaped slice (M M * E), FP8 with the published exclusions, dummy weights (same seed, same weights): the
    Triton bundle's prefill logits (W8A8: `_scaled_mm` dense GEMMs, e4m3 grouped GEMMs for the experts) within 15 %
    of the torch bundle running the same W8A8 math (`fp8_linear_ref`, `fp8_moe_experts_ref` with the activations
    quantized), and within 35 % of the torch bundle's weight-only math. This random slice amplifies small input
    changes (measured on CPU with the torch references: the e4m3 rounding of the Mamba projections' inputs moves the
    logits by ~11 %, in_proj and out_proj ~8 % each, though the inputs stay within the input scale's range, so no
    input scale does better; 0.4 % rms noise on the FP8 linears' inputs moves them 11 % under W8A8, 5 % weight-only),
    and the bundles' bf16 roundings differ (Triton vs torch norms, scan, conv), which moves some e4m3 roundings. A
    broken kernel is off by ~100 %. Then it generates through CUDA graphs (batch-1 FP8 GEMVs, weight-only) with
    finite logprobs."""
    import dataclasses
    import functools

    from service.engine import Engine, EngineConfig, SamplingParams
    from service.engine.kernels.triton_moe_gemv import TILED_FP8_W8A8
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
    a, weight_only = (full_prefill_logits(engines[kb], ids) for kb in ("triton", "torch"))
    model = engines["torch"].runner.model
    model.kernels = dataclasses.replace(
        model.kernels,
        fp8_linear=fp8.fp8_linear_ref,
        fp8_moe_experts=functools.partial(fp8.fp8_moe_experts_ref, quantize_activations=TILED_FP8_W8A8),
    )
    w8a8 = full_prefill_logits(engines["torch"], ids)
    assert torch.isfinite(a).all()
    assert rel(a, w8a8) < 0.15 and rel(a, weight_only) < 0.35, (rel(a, w8a8), rel(a, weight_only))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = engines["triton"].generate([[5 + i for i in range(n)] for n in (3, 40, 100)], params)
    assert engines["triton"].runner.graphs is not None and engines["triton"].runner.graphs.num_replays > 0
    assert all(len(o.token_ids) == 8 and all(map(math.isfinite, o.logprobs)) for o in outs)
