"""Host packing of a CUDA-graph decode step equals the eager batch builder's tensors (CPU: no graph needed).

`pack_decode_inputs` (vectorised, used before every graph replay) and `build_forward_batch` (the eager path,
itself covered by the transformers parity tests) are independent code; on real decode steps of a running
engine (requests at different lengths, prompt-side and output-side tokens, pages of varying count) they must
give the same token ids, live slots, KV slot of the new token, prefix lengths and page-table rows, and the
padding rows of the bucket must point at scratch slot 0 / page 0."""

from __future__ import annotations

import numpy as np

from service.engine.runner.batch import build_forward_batch
from service.engine.runner.cuda_graph import is_graphable, pack_decode_inputs
from tests.engine.helpers import greedy, make_engine, random_ids


def test_pack_decode_inputs_equals_batch_builder(tiny_model_dir):
    eng = make_engine(tiny_model_dir, page_size=4, max_num_seqs=8, mamba_cache_strategy="off")
    for i, n in enumerate((3, 9, 14, 5, 22)):
        eng.add_request(random_ids(n, seed=i), greedy(max_tokens=12 + 3 * i))
    checked = 0
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        plan = sched.plan
        if is_graphable(plan, 8, 1 << 20):
            B, bucket = len(sched.scheduled), 8
            w = max(len(s.request.page_ids) for s in sched.scheduled)
            small = np.full((4, bucket), -7, dtype=np.int64)
            table = np.full((bucket, w), -7, dtype=np.int64)
            pack_decode_inputs(plan, 4, small, table)
            ref = build_forward_batch(plan, 4, eng.model_config.chunk_size, eng.runner.device)
            assert small[0, :B].tolist() == ref.input_ids.tolist()
            assert small[1, :B].tolist() == ref.mamba.slot_ids.tolist()
            assert small[2, :B].tolist() == ref.attn.kv_slot_mapping.tolist()
            assert small[3, :B].tolist() == ref.attn.prefix_lens.tolist()
            ref_table = ref.attn.page_table.numpy()
            for i, s in enumerate(sched.scheduled):
                n = len(s.request.page_ids)
                assert table[i, :n].tolist() == ref_table[i, :n].tolist() == s.request.page_ids
            assert not small[:, B:].any() and not table[B:].any()
            checked += 1
        eng._update(sched, eng.runner.execute(plan))
    assert checked >= 20
