"""Attention's fused qkv_proj: loaded from HF q_proj/k_proj/v_proj as its segments, and equal to the three
separate projections (the weights, the GEMM output and the whole layer, on the torch path)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from service.engine.config import ATTENTION, ModelConfig
from service.engine.kernels import get_kernels
from service.engine.layers.meta import AttentionMeta
from service.engine.model.nemotron_h import NemotronHForCausalLM
from service.engine.model.weights import load_weights

PARTS = ("q_proj", "k_proj", "v_proj")


def _load(path: str) -> NemotronHForCausalLM:
    cfg = ModelConfig.from_model_path(path)
    model = NemotronHForCausalLM(cfg, get_kernels("torch"))
    load_weights(model, path, cfg.tie_word_embeddings)
    return model.eval()


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under `backbone.` names (transformers may write `model.`)."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return {("backbone." + n[len("model.") :] if n.startswith("model.") else n): t for n, t in tensors.items()}


def _attention_layers(model: NemotronHForCausalLM) -> list[tuple[int, torch.nn.Module]]:
    layers = [(i, b.mixer) for i, b in enumerate(model.backbone.layers) if b.layer_type == ATTENTION]
    assert layers, "the checkpoint has no attention layer"
    return layers


@pytest.fixture(params=["tiny", "transformers"])
def checkpoint_dir(request, tiny_model_dir, hf_checkpoints) -> str:
    """Our tiny checkpoint (NVIDIA names) and one written by transformers' save_pretrained."""
    return tiny_model_dir if request.param == "tiny" else hf_checkpoints["attn_first_c8"]


def test_fused_rows_equal_checkpoint_qkv(checkpoint_dir):
    model, tensors = _load(checkpoint_dir), _checkpoint(checkpoint_dir)
    names = {n for n, _ in model.named_parameters()}
    for i, layer in _attention_layers(model):
        prefix = f"backbone.layers.{i}.mixer."
        assert not any(prefix + p + ".weight" in names for p in PARTS)
        fused = torch.cat([tensors[prefix + p + ".weight"] for p in PARTS])
        assert layer.qkv_proj.weight.shape == fused.shape
        assert torch.equal(layer.qkv_proj.weight.detach(), fused)
        for name, (param, part) in layer.checkpoint_parts().items():
            assert param == "qkv_proj.weight"
            assert torch.equal(layer.qkv_proj.weight[layer.qkv_proj.local_rows(part)].detach(), tensors[prefix + name])
        assert torch.equal(layer.o_proj.weight.detach(), tensors[prefix + "o_proj.weight"])


@pytest.mark.parametrize("shape", [(4, 2, 16, 64), (32, 2, 128, 2688)])  # tiny, Nano-30B-A3B
@pytest.mark.parametrize("T", [1, 2, 7, 33])
def test_fused_gemm_equals_separate_exactly(shape, T):
    hq, hkv, dh, hidden = shape
    g = torch.Generator().manual_seed(T)
    wq, wk, wv = (torch.randn(n * dh, hidden, generator=g) * 0.02 for n in (hq, hkv, hkv))
    x = torch.randn(T, hidden, generator=g)
    q, k, v = F.linear(x, torch.cat([wq, wk, wv])).split([hq * dh, hkv * dh, hkv * dh], dim=1)
    assert torch.equal(q, F.linear(x, wq)) and torch.equal(k, F.linear(x, wk)) and torch.equal(v, F.linear(x, wv))


def _meta(qlens: list[int], plens: list[int], table: torch.Tensor, page_size: int) -> AttentionMeta:
    slots, qsl = [], [0]
    for i, (l, p) in enumerate(zip(qlens, plens)):
        slots += [int(table[i, t // page_size]) * page_size + t % page_size for t in range(p, p + l)]
        qsl.append(qsl[-1] + l)
    return AttentionMeta(
        torch.tensor(slots),
        table,
        torch.tensor(qsl),
        torch.tensor(plens),
        max(qlens),
        max(p + l for p, l in zip(plens, qlens)),
        page_size,
    )


def _separate_forward(layer, w: dict[str, torch.Tensor], h, meta, k_cache, v_cache, kernels) -> torch.Tensor:
    """The layer as three projections (the pre-fusion code path), with the same attention kernels as the layer:
    only the projections differ between the two sides."""
    T = h.shape[0]
    q = F.linear(h, w["q_proj.weight"]).view(T, layer.hq, layer.dh)
    key = F.linear(h, w["k_proj.weight"]).view(T, layer.hkv, layer.dh)
    value = F.linear(h, w["v_proj.weight"]).view(T, layer.hkv, layer.dh)
    kernels.write_kv(k_cache, v_cache, key, value, meta.kv_slot_mapping, None, None)
    o = kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.page_table,
        meta.query_start_loc,
        meta.prefix_lens,
        meta.max_query_len,
        meta.max_seq_len,
        meta.page_size,
        layer.scale,
        None,
        None,
    )
    return F.linear(o.reshape(T, layer.hq * layer.dh), layer.o_proj.weight)


def test_attention_layer_equals_separate_qkv(tiny_model_dir):
    """Prefill (two requests) then decode of both: same outputs and caches, bit for bit."""
    model, tensors = _load(tiny_model_dir), _checkpoint(tiny_model_dir)
    i, layer = _attention_layers(model)[0]
    w = {p + ".weight": tensors[f"backbone.layers.{i}.mixer.{p}.weight"] for p in PARTS}
    page_size, hidden = 4, model.cfg.hidden_size
    table = torch.tensor([[1, 2], [3, 0]])
    caches = [torch.zeros(5 * page_size, layer.hkv, layer.dh) for _ in range(4)]  # fused k, v; separate k, v
    g = torch.Generator().manual_seed(0)
    kernels = get_kernels("torch")
    with torch.inference_mode():
        for qlens, plens in (([5, 3], [0, 0]), ([1, 1], [5, 3])):
            meta = _meta(qlens, plens, table, page_size)
            h = torch.randn(sum(qlens), hidden, generator=g)
            fused = layer(h, meta, caches[0], caches[1], kernels)
            separate = _separate_forward(layer, w, h, meta, caches[2], caches[3], kernels)
            assert torch.equal(fused, separate)
            assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


def test_split_qkv_returns_views(tiny_model_dir):
    layer = _attention_layers(_load(tiny_model_dir))[0][1]
    qkv = torch.randn(3, layer.qkv_proj.out_features)
    for part in layer.split_qkv(qkv):
        assert part.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert part.stride() == (qkv.shape[1], layer.dh, 1)


def _rewrite(src: str, dst: str, edit) -> str:
    """A copy of checkpoint folder src with its tensors passed through edit(dict)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as out:
                out.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_loader_names_missing_and_fused_tensors(tiny_model_dir, tmp_path):
    k_name = next(n for n in _checkpoint(tiny_model_dir) if n.endswith("k_proj.weight"))
    missing = _rewrite(tiny_model_dir, str(tmp_path / "missing"), lambda t: t.pop(k_name))
    with pytest.raises(ValueError, match=r"missing tensors \['" + k_name.replace(".", r"\.")):
        _load(missing)
    fused_name = k_name.replace("k_proj", "qkv_proj")
    extra = _rewrite(
        tiny_model_dir,
        str(tmp_path / "extra"),
        lambda t: t.update({fused_name: torch.cat([t[k_name.replace("k_", p[0] + "_")] for p in PARTS])}),
    )
    with pytest.raises(ValueError, match=r"unexpected tensors \['" + fused_name.replace(".", r"\.")):
        _load(extra)
    bad_shape = _rewrite(tiny_model_dir, str(tmp_path / "shape"), lambda t: t.update({k_name: t[k_name][:-1]}))
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        _load(bad_shape)
