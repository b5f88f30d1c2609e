"""CompileWatch (service/engine/kernels/compile_watch.py): the kernel variants loaded after start-up are counted,
named and logged; closing the watch restores Triton's hook. On a GPU, a real launch of a new specialization fires it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from service.engine.kernels.compile_watch import CompileWatch
from tests.kernels.triton_test_util import gpu, needs_cuda


def test_the_hook_counts_names_and_logs_each_variant_then_restores_the_previous(caplog):
    before = triton.knobs.runtime.jit_post_compile_hook
    watch = CompileWatch()
    try:
        hook = triton.knobs.runtime.jit_post_compile_hook
        assert hook is not before
        with caplog.at_level(logging.WARNING, logger="hybrid_serve.engine"):
            for name in ("_scan_kernel", "_gemv_kernel"):
                hook(key="k", repr=f"{name}[num_warps=4](n: i32)", fn=SimpleNamespace(name=name), compile={},
                     is_manual_warmup=False, already_compiled=False)  # fmt: skip
        assert watch.num_compiles == 2
        assert watch.take() == ["_scan_kernel", "_gemv_kernel"] and watch.take() == []
        assert [r.getMessage().split("missed): ", 1)[1] for r in caplog.records] == [
            "_scan_kernel[num_warps=4](n: i32)",
            "_gemv_kernel[num_warps=4](n: i32)",
        ]
    finally:
        watch.close()
    assert triton.knobs.runtime.jit_post_compile_hook is before


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


@gpu
@needs_cuda
def test_a_new_specialization_launched_on_the_gpu_is_seen():
    x = torch.zeros(64, device="cuda")
    _add_one_kernel[(1,)](x, 17, BLOCK=64)  # n neither 1 nor a multiple of 16
    watch = CompileWatch()
    try:
        _add_one_kernel[(1,)](x, 19, BLOCK=64)  # the same variant: nothing new
        assert watch.num_compiles == 0
        _add_one_kernel[(1,)](x, 32, BLOCK=64)  # n a multiple of 16: another variant
        torch.cuda.synchronize()
        assert watch.num_compiles == 1 and watch.take() == ["_add_one_kernel"]
    finally:
        watch.close()
    assert x[:17].eq(3).all() and x[17:19].eq(2).all() and x[19:32].eq(1).all() and x[32:].eq(0).all()
