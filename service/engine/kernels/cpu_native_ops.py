"""Launchers of the compiled CPU kernels (csrc/cpu_decode.c, loaded by `cpu_native`) for the "native" bundle: shape,
dtype and stride checks, then one C call. Same contracts as the references they replace (the oracles the tests
compare against): `ssd.selective_state_update_slots_raw_dt_ref`, `conv1d.causal_conv1d_update_slots_ref`,
`conv1d.causal_conv1d_varlen_ref`, `attention.paged_attention_ref`, `moe.moe_experts_ref`,
`norm.gated_norm_linear_ref`, `norm.add_rms_norm_ref`, `norm.add_rms_norm_linear_ref`, `moe.moe_route_ref`.

Which inputs the kernels take (fp32 operands on the CPU, the pools contiguous), and what runs otherwise, each
launcher says; the other cases run the torch bundle's op (`cpu_ssd`, `cpu_conv1d`, `cpu_attention`, `cpu_moe`,
`cpu_norm`), by an
explicit dtype/device test, never by catching an error. The engine's fp32 CPU decode step takes the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels import cpu_attention, cpu_conv1d, cpu_moe, cpu_norm, cpu_ssd
from service.engine.kernels.attention import _check_bounds
from service.engine.kernels.cpu_native import native_library
from service.engine.kernels.moe import check_shared_expert, moe_route_ref
from service.engine.kernels.ssd import ChunkLayout

MOE_MAX_PAIRS = 512  # (token, pick) pairs up to which the routed experts run in the kernel (decode batches); more
#                      (prefill) run `cpu_moe`'s grouped GEMMs


def _fp32_cpu(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [R, ...] as fp32 whose rows are each contiguous (any row stride): t itself when it is, else a copy."""
    if t.dtype != torch.float32:
        t = t.float()
    if t.stride(-1) == 1 and (t.dim() < 3 or t.stride(-2) == t.shape[-1]):
        return t
    return t.contiguous()


def _flat(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A small operand (parameters per head or channel, index lists) contiguous in dtype: t itself when it is."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _distinct(slot_ids: torch.Tensor) -> bool:
    """Whether slot_ids [B] has no repeats (the kernels advance each slot in place, row by row: rows sharing a slot,
    as padding rows on the scratch slot do, would read a state another row already advanced)."""
    ids = slot_ids.tolist()
    return len(set(ids)) == len(ids)


def _check(status: int, what: str, num: int) -> None:
    if status != 0:
        raise ValueError(f"{what} must lie in [0, {num})")


def selective_state_update_slots_raw_dt(
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_clamp: tuple[float, float],
) -> torch.Tensor:
    """`ssd.selective_state_update_slots_raw_dt_ref`: ssm_pool [S, H, P, N] updated in place at slot_ids [Bt]
    (distinct, except padding rows on the scratch slot), x [Bt, H, P], raw dt [Bt, H], A_log/D/dt_bias [H],
    B/C [Bt, G, N] -> y [Bt, H, P] fp32. A contiguous fp32 pool on the CPU and distinct slots: the kernel
    (`hs_ssu_f32`, one pass over each state); otherwise `cpu_ssd.selective_state_update_slots_raw_dt`."""
    if not (_fp32_cpu(ssm_pool) and ssm_pool.is_contiguous() and _distinct(slot_ids)):
        return cpu_ssd.selective_state_update_slots_raw_dt(ssm_pool, slot_ids, x, dt, A_log, B, C, D, dt_bias, dt_clamp)
    S, H, P, N = ssm_pool.shape
    Bt, G = x.shape[0], B.shape[1]
    if x.shape != (Bt, H, P) or dt.shape != (Bt, H) or B.shape != (Bt, G, N) or C.shape != B.shape or H % G:
        raise ValueError(
            f"ssu shapes: pool {tuple(ssm_pool.shape)}, x {tuple(x.shape)}, dt {tuple(dt.shape)}, B/C {tuple(B.shape)}"
        )
    y = torch.empty(Bt, H, P, dtype=torch.float32)
    if Bt == 0:
        return y
    ids = _flat(slot_ids, torch.int64)
    x, dt, B, C = _rows(x), _rows(dt), _rows(B), _rows(C)
    A_log, D, dt_bias = _flat(A_log), _flat(D), _flat(dt_bias)
    status = native_library().hs_ssu_f32(
        ssm_pool.data_ptr(), S, ids.data_ptr(), Bt, H, P, N, G,
        x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), A_log.data_ptr(),
        B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), D.data_ptr(), dt_bias.data_ptr(),
        float(dt_clamp[0]), float(dt_clamp[1]), y.data_ptr(),
    )  # fmt: skip
    _check(status, "slot_ids", S)
    return y


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd.ssd_varlen_ref`: x [T, H, P], dt [T, H] fp32 (softplus'd), A [H], B/C [T, G, N], D [H], initial_states
    [B, H, P, N] -> (y [T, H, P] fp32, chunk_states [Nc, H, P, N] fp32). fp32 states and inputs on the CPU: the
    kernel (`hs_ssd_scan_f32`: the recurrence token after token, each head's state in the core's cache, stored at
    every chunk end; on one core it beat `cpu_ssd`'s batched matmuls from 64 to 8192 tokens); otherwise
    `cpu_ssd.ssd_varlen` (bf16 states: rounded at every chunk end, as the reference does)."""
    if not _fp32_cpu(x, dt, B, C, initial_states):
        return cpu_ssd.ssd_varlen(x, dt, A, B, C, D, initial_states, layout)
    T, H, P = x.shape
    nb, G, N, nc = initial_states.shape[0], B.shape[1], B.shape[2], len(layout.chunk_lens_host)
    if dt.shape != (T, H) or B.shape != (T, G, N) or C.shape != B.shape or initial_states.shape[1:] != (H, P, N):
        raise ValueError(
            f"ssd shapes: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B/C {tuple(B.shape)}, "
            f"initial_states {tuple(initial_states.shape)}"
        )
    if H % G or layout.first_chunk.shape != (nb,):
        raise ValueError(f"heads {H} not divisible by groups {G}, or a layout of other than {nb} requests")
    y = torch.empty(T, H, P, dtype=torch.float32)
    states = torch.empty(nc, H, P, N, dtype=torch.float32)
    if T == 0:
        return y, states
    xs, dts, Bs, Cs = _rows(x), _rows(dt), _rows(B), _rows(C)
    A, D, init = _flat(A), _flat(D), initial_states.contiguous()
    first, count = _flat(layout.first_chunk, torch.int64), _flat(layout.num_chunks, torch.int64)
    start, length = _flat(layout.chunk_start, torch.int64), _flat(layout.chunk_len, torch.int64)
    status = native_library().hs_ssd_scan_f32(
        nb, H, P, N, G, xs.data_ptr(), xs.stride(0), dts.data_ptr(), dts.stride(0), A.data_ptr(), Bs.data_ptr(),
        Bs.stride(0), Cs.data_ptr(), Cs.stride(0), D.data_ptr(), init.data_ptr(), first.data_ptr(), count.data_ptr(),
        start.data_ptr(), length.data_ptr(), nc, T, y.data_ptr(), states.data_ptr(),
    )  # fmt: skip
    _check(status, "the chunk layout's chunks and tokens", nc)
    return y, states


def causal_conv1d_update_slots(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """`conv1d.causal_conv1d_update_slots_ref`: x [B, D], weight [D, K], bias [D] or None, conv_pool [S, D, K-1]
    updated in place at slot_ids [B] -> silu(conv) [B, D] in x's dtype. A contiguous fp32 pool on the CPU and
    distinct slots: the kernel (`hs_conv_update_f32`); otherwise `cpu_conv1d.causal_conv1d_update_slots`."""
    if not (_fp32_cpu(conv_pool) and conv_pool.is_contiguous() and x.device.type == "cpu" and _distinct(slot_ids)):
        return cpu_conv1d.causal_conv1d_update_slots(x, weight, bias, conv_pool, slot_ids)
    S, Dm, km1 = conv_pool.shape
    Bt = x.shape[0]
    if x.shape != (Bt, Dm) or weight.shape != (Dm, km1 + 1) or (bias is not None and bias.shape != (Dm,)):
        raise ValueError(
            f"conv shapes: pool {tuple(conv_pool.shape)}, x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    out = torch.empty(Bt, Dm, dtype=torch.float32)
    if Bt == 0:
        return out.to(x.dtype)
    ids, xs, w = _flat(slot_ids, torch.int64), _rows(x), _flat(weight)
    b = None if bias is None else _flat(bias)
    status = native_library().hs_conv_update_f32(
        conv_pool.data_ptr(), S, ids.data_ptr(), Bt, Dm, km1 + 1, xs.data_ptr(), xs.stride(0), w.data_ptr(),
        None if b is None else b.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    _check(status, "slot_ids", S)
    return out.to(x.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    page_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention.paged_attention_ref`: q [T, Hq, Dh], caches [S, Hkv, Dh], page_table [B, pages], query_start_loc
    [B+1], prefix_lens [B] -> [T, Hq, Dh] in q's dtype. fp32 q and contiguous fp32 caches on the CPU without scales:
    the one-query (decode) requests in one kernel call (`hs_decode_attention_f32`: keys read in place through the
    page table, no gather), the others as `cpu_attention` runs them; other inputs: `cpu_attention.paged_attention`."""
    args = (q, k_cache, v_cache, page_table, query_start_loc, prefix_lens, max_query_len, max_seq_len, page_size)
    if not (_fp32_cpu(q, k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()) or (
        k_scale is not None or v_scale is not None
    ):
        return cpu_attention.paged_attention(*args, scale, k_scale, v_scale)
    qsl, plens = query_start_loc.tolist(), prefix_lens.tolist()
    _check_bounds(qsl, plens, max_query_len, max_seq_len)
    out = torch.empty(q.shape, dtype=torch.float32)
    decode = [i for i in range(len(plens)) if qsl[i + 1] - qsl[i] == 1]
    if decode:
        _decode_rows(out, q, k_cache, v_cache, page_table, page_size, scale, decode, qsl, plens)
    groups: dict[tuple[int, int], list[int]] = {}  # (prefix, new tokens) -> requests, as cpu_attention runs them
    for i, p in enumerate(plens):
        if qsl[i + 1] - qsl[i] > 1:
            groups.setdefault((p, qsl[i + 1] - qsl[i]), []).append(i)
    for (p, n), reqs in groups.items():
        cpu_attention._prefill(
            out, q, k_cache, v_cache, page_table, page_size, scale, [qsl[i] for i in reqs], p, n, reqs
        )
    return out


def _decode_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    reqs: list[int],
    qsl: list[int],
    plens: list[int],
) -> None:
    """out[qsl[i]] = attention of request i's one query over its plens[i] + 1 keys, for i in reqs (one C call)."""
    Hq, Dh = q.shape[1], q.shape[2]
    S, Hkv = k_cache.shape[0], k_cache.shape[1]
    ctx = [plens[i] + 1 for i in reqs]
    if k_cache.shape[2] != Dh or Hq % Hkv or max(ctx) > page_table.shape[1] * page_size or qsl[-1] > q.shape[0]:
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, contexts {ctx}")
    qs, pt = _rows(q), _flat(page_table, torch.int64)
    tok, req, ctx_t = (torch.tensor(v, dtype=torch.int64) for v in ([qsl[i] for i in reqs], reqs, ctx))
    scratch = torch.empty((Hq // Hkv + 2) * max(ctx), dtype=torch.float32)
    status = native_library().hs_decode_attention_f32(
        qs.data_ptr(), qs.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), S, pt.data_ptr(), pt.stride(0),
        page_size, tok.data_ptr(), req.data_ptr(), ctx_t.data_ptr(), len(reqs), Hq, Hkv, Dh, float(scale),
        out.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    _check(status, "page_table entries", S // page_size)


def moe_weight_layout(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.moe_weight_layout_ref` for this bundle: fp32 on the CPU, up [E, I, d] returned as a view of its values
    stored [E, d, I] and down [E, d, I] as a view of its values stored [E, I, d] (row-major: each expert's weights one
    block that the kernel streams; `cpu_moe.moe_experts`' grouped GEMMs read both as they are); other dtypes and
    devices as loaded."""
    if down.device.type != "cpu" or down.dtype != torch.float32:
        return up, down
    return up.transpose(1, 2).contiguous().transpose(1, 2), down.transpose(1, 2).contiguous().transpose(1, 2)


def _native_moe_layout(up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether up [E, I, d] and down [E, d, I] are fp32 views of `moe_weight_layout`'s storage with d and I
    multiples of the kernel's 16 lanes."""
    E, I, d = up.shape
    return (
        up.dtype == down.dtype == torch.float32
        and d % 16 == 0
        and I % 16 == 0
        and up.stride() == (d * I, 1, I)
        and down.stride() == (I * d, 1, d)
    )


def moe_experts(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe.moe_experts_ref`: x [T, d], up [E, I, d], down [E, d, I], topk_weights/topk_ids [T, k] -> [T, d] in x's
    dtype, plus the shared expert (shared_up [S, d], shared_down [d, S]) when given. fp32 on the CPU with the weights
    in `moe_weight_layout` and at most MOE_MAX_PAIRS picks: the routed experts in the kernel (`hs_moe_experts_f32`:
    each picked expert's weights streamed in order, its tokens in tiles that share each weight read), the shared
    expert as two GEMMs; otherwise `cpu_moe.moe_experts`."""
    if not (
        _fp32_cpu(x) and x.device == up.device and topk_ids.numel() <= MOE_MAX_PAIRS and _native_moe_layout(up, down)
    ):
        return cpu_moe.moe_experts(x, up, down, topk_weights, topk_ids, shared_up=shared_up, shared_down=shared_down)
    T, d = x.shape
    E, I = up.shape[0], up.shape[1]
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T or up.shape[2] != d or down.shape != (E, d, I):
        raise ValueError(f"moe shapes: x {tuple(x.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
    if check_shared_expert(x, shared_up, shared_down):
        out = F.linear(F.linear(x, shared_up).relu_().square_(), shared_down).float()
    else:
        out = torch.zeros(T, d, dtype=torch.float32)
    xs, ids, w = _rows(x), _flat(topk_ids, torch.int64), _flat(topk_weights)
    iscratch = torch.empty(ids.numel() + E, dtype=torch.int64)
    fscratch = torch.empty(4 * I, dtype=torch.float32)
    status = native_library().hs_moe_experts_f32(
        xs.data_ptr(), xs.stride(0), T, d, I, E, up.data_ptr(), down.data_ptr(), ids.data_ptr(), w.data_ptr(),
        ids.shape[1], out.data_ptr(), iscratch.data_ptr(), fscratch.data_ptr(),
    )  # fmt: skip
    _check(status, "topk_ids", E)
    return out


def moe_route(
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.moe_route_ref`: h [T, d], gate_weight [E, d] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64).
    fp32 h and gate weight on the CPU, one expert group (n_group 1): the logits as the reference computes them
    (`F.linear`), then sigmoid, top-k and the weights in the kernel (`hs_moe_route_f32`); other inputs, and logits
    holding a NaN, run the reference."""
    args = (h, gate_weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
    if not (_fp32_cpu(h, gate_weight) and n_group == 1 and h.dim() == 2):
        return moe_route_ref(*args)
    E = gate_weight.shape[0]
    if not 0 < top_k <= E or correction_bias.shape != (E,):
        raise ValueError(f"router: top_k {top_k} must lie in [1, {E}] and correction_bias be [{E}], got "
                         f"{tuple(correction_bias.shape)}")  # fmt: skip
    logits = F.linear(h, gate_weight)  # [T, E] contiguous
    T = logits.shape[0]
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    bias, scratch = _flat(correction_bias), torch.empty(2 * E, dtype=torch.float32)
    status = native_library().hs_moe_route_f32(
        logits.data_ptr(), T, E, bias.data_ptr(), top_k, int(norm_topk_prob), float(scaling), weights.data_ptr(),
        ids.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return (weights, ids) if status == 0 else moe_route_ref(*args)


def _at_row(t: torch.Tensor, row: int) -> int:
    """Address of row `row` of t [R, ...] (fp32)."""
    return t.data_ptr() + row * t.stride(0) * t.element_size()


def gated_norm_linear(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    group_size: int,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`norm.gated_norm_linear_ref`: y, z [T, Di] (any row strides), norm_weight [Di], weight [N, Di] -> [T, N].
    fp32 on the CPU: the gated group norm in the kernel (`hs_gated_norm_f32`), `cpu_norm.NORM_BLOCK_ROWS` rows at a
    time, each block's linear right after it (its normed rows still in cache); otherwise `cpu_norm.gated_norm_linear`."""
    if not (_fp32_cpu(y, z, weight) and y.dim() == 2):
        return cpu_norm.gated_norm_linear(y, z, norm_weight, group_size, eps, weight, bias)
    T, Di = y.shape
    if z.shape != y.shape or Di % group_size or norm_weight.shape != (Di,) or weight.shape[1] != Di:
        raise ValueError(f"gated norm shapes: y {tuple(y.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    ys, zs, w = _rows(y), _rows(z), _flat(norm_weight)
    block = cpu_norm.NORM_BLOCK_ROWS
    normed = torch.empty(min(T, block), Di, dtype=torch.float32)
    out = torch.empty(T, weight.shape[0], dtype=torch.float32)
    for r0 in range(0, T, block):
        n = min(T, r0 + block) - r0
        native_library().hs_gated_norm_f32(
            _at_row(ys, r0), ys.stride(0), _at_row(zs, r0), zs.stride(0), n, Di, group_size, w.data_ptr(),
            float(eps), normed.data_ptr(),
        )  # fmt: skip
        if bias is None:
            torch.mm(normed[:n], weight.t(), out=out[r0 : r0 + n])
        else:
            torch.addmm(bias, normed[:n], weight.t(), out=out[r0 : r0 + n])
    return out


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    init_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
) -> torch.Tensor:
    """`conv1d.causal_conv1d_varlen_ref`: x [T, D] (any row stride), weight [D, K], bias [D] or None, init_states
    [B, D, K-1], query_start_loc [B+1], token_req [T] -> silu(conv(x) + bias) [T, D]. fp32 x and states on the CPU:
    the kernel (`hs_conv_varlen_f32`, token rows in place, no window copies); otherwise
    `cpu_conv1d.causal_conv1d_varlen`."""
    if not (_fp32_cpu(x, init_states) and x.dim() == 2):
        return cpu_conv1d.causal_conv1d_varlen(x, weight, bias, init_states, query_start_loc, token_req)
    T, Dm = x.shape
    B, K = init_states.shape[0], weight.shape[1]
    qsl = query_start_loc.tolist()
    if (
        weight.shape[0] != Dm
        or init_states.shape[1:] != (Dm, K - 1)
        or len(qsl) != B + 1
        or qsl[0] != 0
        or qsl[-1] != T
        or any(a > b for a, b in zip(qsl, qsl[1:]))
    ):
        raise ValueError(f"conv shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, states "
                         f"{tuple(init_states.shape)}, query_start_loc {qsl}")  # fmt: skip
    xs, w, st, q = _rows(x), _flat(weight), init_states.contiguous(), _flat(query_start_loc, torch.int64)
    b = None if bias is None else _flat(bias)
    out = torch.empty(T, Dm, dtype=torch.float32)
    taps = torch.empty(K * Dm, dtype=torch.float32)
    native_library().hs_conv_varlen_f32(
        xs.data_ptr(), xs.stride(0), Dm, K, w.data_ptr(), None if b is None else b.data_ptr(), st.data_ptr(),
        q.data_ptr(), B, out.data_ptr(), taps.data_ptr(),
    )  # fmt: skip
    return out


def _add_rms_norm_into(
    normed: torch.Tensor,
    new_residual: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
) -> None:
    """normed, new_residual [n, d] (contiguous) = `norm.add_rms_norm_ref` of x, residual [n, d] (rows contiguous)."""
    n, d = x.shape
    native_library().hs_add_rms_norm_f32(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), n, d, w.data_ptr(), float(eps),
        new_residual.data_ptr(), normed.data_ptr(),
    )  # fmt: skip


def _add_norm_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this residual add + norm: fp32 [T, d] on the CPU, the norm weight [d]."""
    return _fp32_cpu(x, residual) and x.dim() == 2 and x.shape == residual.shape and weight.shape == x.shape[1:]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.add_rms_norm_ref`: x, residual [T, d] -> (normed, new_residual). fp32 on the CPU: the kernel
    (`hs_add_rms_norm_f32`, one pass per row); otherwise `cpu_norm.add_rms_norm`."""
    if not _add_norm_inputs(x, residual, weight):
        return cpu_norm.add_rms_norm(x, residual, weight, eps)
    normed, new_residual = torch.empty(x.shape, dtype=torch.float32), torch.empty(x.shape, dtype=torch.float32)
    if x.shape[0]:
        _add_rms_norm_into(normed, new_residual, _rows(x), _rows(residual), _flat(weight), eps)
    return normed, new_residual


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.add_rms_norm_linear_ref`: x, residual [T, K], weight [N, K] -> (y [T, N], new_residual [T, K]). fp32
    on the CPU: the add and norm in the kernel, `cpu_norm.NORM_BLOCK_ROWS` rows at a time, each block's linear right
    after it; otherwise `cpu_norm.add_rms_norm_linear`."""
    if not (_add_norm_inputs(x, residual, norm_weight) and weight.dtype == torch.float32):
        return cpu_norm.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    T, K = x.shape
    xs, rs, w = _rows(x), _rows(residual), _flat(norm_weight)
    block = cpu_norm.NORM_BLOCK_ROWS
    new_residual = torch.empty(T, K, dtype=torch.float32)
    normed = torch.empty(min(T, block), K, dtype=torch.float32)
    y = torch.empty(T, weight.shape[0], dtype=torch.float32)
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        _add_rms_norm_into(normed[: r1 - r0], new_residual[r0:r1], xs[r0:r1], rs[r0:r1], w, eps)
        if bias is None:
            torch.mm(normed[: r1 - r0], weight.t(), out=y[r0:r1])
        else:
            torch.addmm(bias, normed[: r1 - r0], weight.t(), out=y[r0:r1])
    return y, new_residual
