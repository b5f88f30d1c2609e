"""Memory-plan arithmetic against sizes computed by hand."""

from __future__ import annotations

import json

import pytest
import torch

from service.engine.runner.memory_plan import GiB, plan_memory, state_bytes, useful_pages


def nano_state_bytes(page_size: int = 64):
    # Nano: 6 attention layers, 2 KV heads x 128, bf16; 23 Mamba layers, conv_dim 6144, K 4 (bf16), 64 x 64 x 128 fp32
    return state_bytes(6, page_size, 2, 128, 2, 23, 6144, 4, 2, 64, 64, 128)


def test_state_bytes_by_hand():
    s = nano_state_bytes()
    assert s.kv_page == 6 * 2 * 64 * 2 * 128 * 2 == 393_216  # 384 KiB per 64-token page
    assert s.mamba_slot == 23 * (6144 * 3 * 2 + 64 * 64 * 128 * 4) == 23 * (36_864 + 2_097_152) == 49_082_368
    half = state_bytes(6, 64, 2, 128, 2, 23, 6144, 4, 2, 64, 64, 128, ssm_elem=2)  # mamba_ssm_cache_dtype bfloat16
    assert half.mamba_slot == 23 * (36_864 + 1_048_576) == 24_965_120 and half.kv_page == s.kv_page


def test_plan_by_hand():
    s = nano_state_bytes()
    plan = plan_memory(
        total_bytes=140 * GiB,
        utilization=0.9,
        weights_bytes=32 * GiB,
        activation_bytes=3 * GiB,
        graph_bytes=1 * GiB,
        sizes=s,
        max_num_seqs=256,
        max_model_len=4096,
        page_size=64,
        max_snapshots=512,
        max_pages=10**9,
    )
    # by hand: budget 0.9 * 140 GiB = 135,291,469,824; minus 36 GiB -> 96,636,764,160 left; 256 live slots take
    # 12,565,086,208 -> 84,071,677,952; a quarter of that is 21,017,919,488 = 428.2 slots (< 2 x 256 asked);
    # the rest, 84,071,677,952 - 428 * 49,082,368 = 63,064,424,448, is 160,381.3 pages
    assert (plan.budget_bytes, plan.num_live_slots, plan.num_snapshot_slots, plan.num_kv_pages) == (
        135_291_469_824,
        256,
        428,
        160_381,
    )
    left = 96_636_764_160
    assert plan.mamba_live_bytes + plan.mamba_snapshot_bytes + plan.kv_bytes + plan.free_bytes == left
    assert 0 <= plan.free_bytes < 393_216
    assert "160381 pages" in plan.log_line() and plan.stats()["memory_plan_num_kv_pages"] == 160_381


def test_two_snapshots_per_request_when_they_fit():
    s = nano_state_bytes()
    # 80 GiB, all usable, 60 + 1 GiB used: 19 GiB = 20,401,094,656 left; 64 live slots 3,141,271,552 -> 17,259,823,104;
    # a quarter (4,314,955,776) holds 87 slots, fewer than the 2 x 64 asked
    plan = plan_memory(80 * GiB, 1.0, 60 * GiB, 1 * GiB, 0, s, 64, 2048, 64, max_snapshots=128, max_pages=10**9)
    assert plan.num_snapshot_slots == 87
    plan = plan_memory(80 * GiB, 1.0, 60 * GiB, 1 * GiB, 0, s, 16, 2048, 64, max_snapshots=32, max_pages=10**9)
    assert plan.num_snapshot_slots == 32  # 2 x 16 fit within the share


def test_kv_pages_stop_at_what_the_requests_can_use():
    s = nano_state_bytes()
    cap = useful_pages(8, 4096, 64)
    assert cap == 2 * 8 * 64 == 1024
    plan = plan_memory(140 * GiB, 0.9, 32 * GiB, 3 * GiB, GiB, s, 8, 4096, 64, max_snapshots=0, max_pages=cap)
    assert plan.num_kv_pages == 1024 and plan.kv_bytes == 1024 * 393_216
    assert plan.free_bytes == int(140 * GiB * 0.9) - 36 * GiB - 8 * s.mamba_slot - 1024 * 393_216


def test_no_prefix_cache_gives_no_snapshot_slots():
    plan = plan_memory(
        80 * GiB, 0.9, 20 * GiB, GiB, GiB, nano_state_bytes(), 64, 2048, 64, max_snapshots=0, max_pages=10**9
    )
    assert plan.num_snapshot_slots == 0 and plan.mamba_snapshot_bytes == 0


def test_a_model_that_does_not_fit_names_the_numbers():
    with pytest.raises(
        ValueError,
        match=r"does not fit: budget 126\.00 GiB .* weights 121\.00 GiB .*"
        r"raise gpu_memory_utilization",
    ):
        plan_memory(140 * GiB, 0.9, 121 * GiB, 4 * GiB, GiB, nano_state_bytes(), 256, 262144, 64, 512, 10**9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_cuda_sizes_its_pools_from_the_plan(tmp_path):
    """A dummy Nano slice on the GPU: the pools are the plan's, the plan is in the stats, and a budget below the
    weights is refused with the numbers."""
    from service.engine import Engine, EngineConfig
    from service.testing.model_dir import published_config

    cfg = published_config("nano")
    cfg.update(hybrid_override_pattern="M*E", num_hidden_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    base = dict(
        model_path=str(tmp_path),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_seqs=8,
        max_model_len=4096,
        cuda_graphs=False,
    )
    engine = Engine(EngineConfig(**base, gpu_memory_utilization=0.5))
    plan = engine.runner.memory_plan
    assert plan is not None and engine.cache.pools.pages.num_usable == plan.num_kv_pages
    assert plan.num_kv_pages == useful_pages(8, 4096, 16)  # 0.5 of the GPU holds more than that
    assert plan.budget_bytes == int(torch.cuda.mem_get_info()[1] * 0.5) and plan.activation_bytes > 0
    assert engine.stats()["memory_plan_num_kv_pages"] == plan.num_kv_pages
    assert plan.num_live_slots == 8 and plan.weights_bytes > 2 * 128 * 2688 * 1856 * 2
    del engine
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match="does not fit"):
        Engine(EngineConfig(**base, gpu_memory_utilization=0.01))


def test_plan_refused_when_other_processes_hold_the_memory():
    """A plan whose pools, graph reserve and activations exceed the memory actually free is refused with the numbers
    (another process holds 16 GiB of a 140 GiB device at utilization 0.9), and accepted when they fit."""
    from service.engine.runner.memory_plan import check_free

    plan = plan_memory(
        total_bytes=140 * GiB,
        utilization=0.9,
        weights_bytes=60 * GiB,
        activation_bytes=1 * GiB,
        graph_bytes=2 * GiB,
        sizes=nano_state_bytes(),
        max_num_seqs=1024,
        max_model_len=2112,
        page_size=64,
        max_snapshots=0,
        max_pages=10**9,
    )
    need = plan.kv_bytes + plan.mamba_live_bytes + plan.graph_bytes + plan.activation_bytes
    assert need == 126 * GiB - 60 * GiB - plan.free_bytes  # everything the budget left after the weights
    check_free(plan, need)
    with pytest.raises(ValueError, match=r"only 63\.00 GiB of the 140\.00 GiB device are free.*about 17\.00 GiB"):
        check_free(plan, 63 * GiB)
