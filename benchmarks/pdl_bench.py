"""Programmatic dependent launch (PDL) on back-to-back decode kernels, one CUDA GPU (Hopper+).

Chains of dependent batch-1 kernels at Nano-30B-A3B shapes are captured in one CUDA graph each, once launched
with PDL and once without, and replayed (do_bench median): with PDL a kernel's programs start while the kernel
before it drains and stream their first weight tile before they wait for its output. Reports device ms per chain,
the weight GB/s it reaches and that as a fraction of the measured copy / read bandwidth (`roofline`).

    PYTHONPATH=. python benchmarks/pdl_bench.py [--links 16] [--out pdl.md]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks import roofline
from service.engine.kernels.triton_gemv import gemv

DEV, BF16 = "cuda", torch.bfloat16
HIDDEN, SHARED_INTER = 2688, 3712  # Nano hidden size, shared-expert intermediate size


def graph_ms(step: Callable[[], torch.Tensor]) -> float:
    """Captures step() in a CUDA graph (after a warm-up that compiles) and returns the median replay ms."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")


def gemv_chain(
    links: int, shapes: tuple[tuple[int, int], ...], linear: Callable
) -> tuple[Callable[[], torch.Tensor], float]:
    """`links` single-row linears cycling over the weight shapes (N, K), each weight its own tensor (the chain is
    far above L2); link i reads link i-1's output when the widths match, else a fixed row. Stream order makes every
    link wait for the one before either way. Returns the chain and its weight bytes."""
    ws = [torch.randn(shapes[i % len(shapes)], device=DEV, dtype=BF16) * 0.02 for i in range(links)]
    rows = {k: torch.randn(1, k, device=DEV, dtype=BF16) for _, k in shapes}

    def chain() -> torch.Tensor:
        y = rows[ws[0].shape[1]]
        for w in ws:
            y = linear(y if y.shape[1] == w.shape[1] else rows[w.shape[1]], w)
        return y

    return chain, sum(w.numel() * w.element_size() for w in ws)


CHAINS = {
    "shared up/down 20 MB": ((SHARED_INTER, HIDDEN), (HIDDEN, SHARED_INTER)),
    "mamba in_proj 55 MB": ((10304, HIDDEN),),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=16, help="kernels per chain")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    copy, read = roofline.copy_gbs(DEV), roofline.read_gbs(DEV)
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; ceilings: 1 GiB copy {copy:.0f} GB/s (read + write), "
        f"1 GiB read {read:.0f} GB/s",
        "",
        "| chain | device ms per chain | us per kernel | weight GB/s | % copy | % read |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    variants = {
        "cuBLAS F.linear": F.linear,
        "Triton gemv, no PDL": lambda x, w: gemv(x, w, pdl=False),
        "Triton gemv, PDL": lambda x, w: gemv(x, w, pdl=True),
    }
    errs = []
    for chain_name, shapes in CHAINS.items():
        outs = {}
        for name, linear in variants.items():
            torch.manual_seed(0)
            chain, nbytes = gemv_chain(args.links, shapes, linear)
            ms = graph_ms(chain)
            outs[name] = chain()
            gbs = nbytes / ms / 1e6
            lines.append(
                f"| {chain_name}: {args.links} x {name} | {ms:.4f} | {1e3 * ms / args.links:.2f} | {gbs:.0f} "
                f"| {100 * gbs / copy:.0f}% | {100 * gbs / read:.0f}% |"
            )
            print(lines[-1], flush=True)
            del chain
        ref = outs["Triton gemv, no PDL"].float()
        errs.append((outs["Triton gemv, PDL"].float() - ref).abs().max().item())
    lines.append(f"\nmax |PDL - no PDL| over the chain outputs: {max(errs):.3e} (same kernel, same order: expected 0)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
