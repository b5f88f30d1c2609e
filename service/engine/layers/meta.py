"""Per-step metadata the layers read (built once per step by the runner, shared by all layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.kernels.ssd import ChunkLayout


@dataclass(frozen=True)
class AttentionMeta:
    kv_slot_mapping: torch.Tensor  # [T] int64: flat KV slot (page_id * page_size + offset) of each new token
    page_table: torch.Tensor  # [B, max_pages] int64: page ids of each request (padded with 0)
    query_start_loc: torch.Tensor  # [B+1] int64 (device): flat offset of request i's first new token
    prefix_lens: torch.Tensor  # [B] int64 (device): tokens already in the KV cache (p_i)
    max_query_len: int  # host: max_i l_i (1 for a decode-only step); sizes the prefill grid
    max_seq_len: int  # host: upper bound on p_i + l_i (the decode split-KV plan is sized from it)
    page_size: int  # tokens per page


@dataclass(frozen=True)
class SnapshotPlan:
    """States to copy into snapshot slots during this forward (docs/design.md: Slot protocol)."""

    req_idx: torch.Tensor  # [n] int64: batch index of the request
    num_new_tokens: torch.Tensor  # [n] int64: r = s - p_i, tokens of this extend before the snapshot point
    chunk_idx: torch.Tensor  # [n] int64: chunk whose end state is the snapshot (prefill path)
    dest_slots: torch.Tensor  # [n] int64: mamba pool slot receiving conv + ssm state

    @property
    def empty(self) -> bool:
        return self.dest_slots.numel() == 0


@dataclass(frozen=True)
class MambaMeta:
    slot_ids: torch.Tensor  # [B] int64: live mamba slot of each request
    query_start_loc: torch.Tensor  # [B+1] int64 (device)
    token_req: torch.Tensor  # [T] int64: request index of each token
    decode_only: bool  # every request has exactly one new token: recurrence path
    layout: ChunkLayout | None  # chunk layout for the SSD path (None when decode_only)
    snapshots: SnapshotPlan  # snapshot copies to make in every mamba layer
    split: MambaSplit | None = None  # a mixed step run in two parts (set only when the kernel bundle asks for it)


@dataclass(frozen=True)
class MambaSplit:
    """A mixed step's rows in two parts, each run by its own path in every mamba layer: the one-token rows by the
    decode recurrence (conv update + selective state update on the pools, by slot), the other rows by the varlen
    conv and chunked scan. Requests are independent (own slots, own snapshot slots), so the two parts compute what
    one varlen pass over all rows does; their outputs go back to the batch's token order."""

    decode_tokens: torch.Tensor  # [Bd] int64: flat token index of each one-token row's token, in batch order
    decode: MambaMeta  # the one-token rows alone (decode_only; their snapshots, req_idx into these rows)
    prefill_tokens: torch.Tensor  # [Tp] int64: flat token indices of the other rows' tokens, in batch order
    prefill: MambaMeta  # the other rows alone (their chunk layout; their snapshots, req_idx into these rows)
