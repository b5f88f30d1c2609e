"""State-level oracle for the prefix cache: a snapshot must equal a cold prefill of its prefix."""

from __future__ import annotations

import torch

from service.engine.canary import max_rel_error
from tests.engine.helpers import greedy


def cold_state(engine_off, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank: conv [L_m, D, K-1] and ssm [L_m, H, P, N] after one cold prefill of exactly `tokens`."""
    assert engine_off.config.mamba_cache_strategy == "off"
    assert engine_off.config.max_num_batched_tokens >= len(tokens)
    # a request that captures states runs one step at a time: after this step its live slot holds the prompt
    rid = engine_off.add_request(tokens, greedy(2), capture_states=True)
    engine_off.step()
    state = engine_off.workers.read_slot(engine_off.requests[rid].live_slot)
    engine_off.abort(rid)
    engine_off.pop_captured_states(rid)
    return state


def snapshot_errors(engine, engine_off) -> dict[int, float]:
    """For every snapshot in engine's tree: prefix length -> max relative error vs the cold state, over every
    rank (each rank's part against the same rank of engine_off, which must have the same tp)."""
    tree = engine.cache.tree
    errors = {}
    for node, depth in tree.snapshot_prefix_lengths():
        cold = cold_state(engine_off, tree.path_tokens(node))
        snap = engine.workers.read_slot(node.snapshot_slot)
        assert len(snap) == len(cold) == engine.config.tp
        errors[depth] = max(max(max_rel_error(a[0], b[0]), max_rel_error(a[1], b[1])) for a, b in zip(snap, cold))
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
