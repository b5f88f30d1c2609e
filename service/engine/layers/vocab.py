"""Vocabulary-parallel embedding and lm_head: rank r holds rows [r * V_local, (r + 1) * V_local) of the vocabulary,
V_local = ceil(vocab_size / tp) (rows past vocab_size, on the last rank, are zero padding).

Embedding: each rank looks up the ids it holds (zeros for the others), then one all-reduce. lm_head: each rank's
logits [R, V_local], all-gathered in rank order and cut to vocab_size. At tp 1 both are the plain ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.engine.distributed.parallel import ParallelContext, RankShapes
from service.engine.kernels import Kernels
from service.engine.layers.linear import Source, copy_into, project, set_loader


def vocab_loader(vocab_size: int, shapes: RankShapes):
    """This rank's vocabulary rows of a [vocab_size, hidden] tensor; padding rows are zero."""
    v0 = shapes.vocab_start

    def load(dst: torch.Tensor, src: Source, part: int | None) -> None:
        if src.shape != (vocab_size, dst.shape[1]):
            raise ValueError(
                f"tensor {src.name!r} has shape {src.shape}, the model expects {(vocab_size, dst.shape[1])}"
            )
        n = max(0, min(vocab_size - v0, dst.shape[0]))
        if n:
            copy_into(dst[:n], src.read((slice(v0, v0 + n), slice(None))), src)
        dst[n:].zero_()

    return load


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden: int, shapes: RankShapes, parallel: ParallelContext):
        super().__init__(shapes.vocab, hidden)
        self.parallel, self.vocab_start = parallel, shapes.vocab_start
        set_loader(self.weight, vocab_loader(vocab_size, shapes))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (ids in [0, vocab_size)) -> [T, hidden], the same on every rank."""
        if self.parallel.tp == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        h = F.embedding(torch.where(held, local, torch.zeros_like(local)), self.weight)
        return self.parallel.all_reduce(h * held.unsqueeze(-1).to(h.dtype))


class ParallelLMHead(nn.Linear):
    def __init__(self, vocab_size: int, hidden: int, shapes: RankShapes, parallel: ParallelContext):
        super().__init__(hidden, shapes.vocab, bias=False)
        self.parallel, self.vocab_size = parallel, vocab_size
        set_loader(self.weight, vocab_loader(vocab_size, shapes))

    def logits(self, x: torch.Tensor, k: Kernels, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, hidden] -> logits [R, vocab_size] fp32 on every rank; out: [R, vocab_size] fp32 to write them into
        (at tp 1 the cast to fp32 writes it directly)."""
        if self.parallel.tp == 1:
            local = project(k, self, x)
            return local.float() if out is None else out.copy_(local)
        full = self.parallel.all_gather(project(k, self, x).float(), dim=-1)[:, : self.vocab_size]
        return full if out is None else out.copy_(full)
