"""State-level oracle for the prefix cache: a snapshot must equal a cold prefill of its prefix."""
from __future__ import annotations

import torch

from service.engine.canary import max_rel_error
from tests.engine.helpers import greedy


def cold_state(engine_off, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """conv [L_m, D, K-1] and ssm [L_m, H, P, N] after one cold prefill of exactly `tokens`."""
    assert engine_off.config.mamba_cache_strategy == "off"
    assert engine_off.config.max_num_batched_tokens >= len(tokens)
    rid = engine_off.add_request(tokens, greedy(2))
    engine_off.step()
    slot = engine_off.requests[rid].live_slot
    pools = engine_off.runner.pools
    state = pools.conv[:, slot].clone(), pools.ssm[:, slot].clone()
    engine_off.abort(rid)
    return state


def snapshot_errors(engine, engine_off) -> dict[int, float]:
    """For every snapshot in engine's tree: prefix length -> max relative error vs the cold state."""
    tree, pools = engine.cache.tree, engine.runner.pools
    errors = {}
    for node, depth in tree.snapshot_prefix_lengths():
        conv, ssm = cold_state(engine_off, tree.path_tokens(node))
        slot = node.snapshot_slot
        errors[depth] = max(max_rel_error(pools.conv[:, slot], conv), max_rel_error(pools.ssm[:, slot], ssm))
    return errors


def buggy_snapshot_chunk_indices(layout, req_idx, positions, prefix_lens):
    """SGLang's bug (issue #31833): offsets from cumsum(l_j // C) instead of the chunk layout."""
    c = layout.chunk_size
    chunk_req = layout.chunk_req.tolist()
    qlens = [0] * len(prefix_lens)
    for r, n in zip(chunk_req, layout.chunk_lens_host):
        qlens[r] += n
    out = []
    for i, s in zip(req_idx, positions):
        start = sum(q // c for q in qlens[:i])
        out.append(start + (s - prefix_lens[i]) // c - 1)
    return out
