"""The tensor-parallel split of a DS4 model (shared/spec/wire.md §2): what each rank holds.

N ranks run the same layers. Rank r holds:

* the routed experts [r·E/N, (r+1)·E/N) of every layer (the three `ffn_*_exps` tensors sliced on
  their outermost, per-expert axis: a contiguous byte range of the file);
* the attention heads [r·H/N, (r+1)·H/N) with their output groups [r·G/N, (r+1)·G/N): the rows of
  `attn_q_b` and `attn_output_a`, the entries of `attn_sinks`, and the columns of
  `attn_output_b` that read those groups (a block-aligned slice of every row, copied once);
* the vocabulary rows `vocab_part(V, N, r)` of the output head;
* the shared expert on rank 0 only;
* everything else whole: the embedding, the mHC weights, the norms, the router (it scores all E
  experts, so every rank makes the same choice), the KV projection, the compressors and the
  indexer. The KV cache is one latent shared by all heads, so every rank holds it whole, and a
  rank's session state is the whole session's: a DSV4 payload from any rank is the session.

Per layer the ranks then hold partial sublayer outputs: the attention output projection over
their groups (gate ATTN) and their routed experts plus, on rank 0, the shared expert (gate FFN).
Each gate sums the N partials `((p0 + p1) + p2) + …` in rank order, so every rank continues from
the same bits. A rank's backend runs the model with `RankPart.config`: the ModelConfig with its
own head and group counts, everything else unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .config import ConfigError, ModelConfig
from .gguf_model import Tensor
from .quants import block_format, row_bytes


class Gate(IntEnum):
    """The records ranks exchange within a layer (wire.md §2; ds4/wire/ds4t/'s gate records)."""

    ATTN = 0  # after the grouped attention output projection: the partial sums
    FFN = 1  # after the routed experts (+ the shared expert on rank 0): the partial sums
    HIDDEN = 2  # ranks on different backends: the leader's hidden state after a sublayer
    ROUTE = 3  # ranks on different backends: the leader's routing (ids as int32 bits, weights)


def part_range(total: int, n_rank: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `total` items split in n_rank parts (floor bounds)."""
    return range(rank * total // n_rank, (rank + 1) * total // n_rank)


class Split(IntEnum):
    """How one tensor is cut between ranks."""

    WHOLE = 0  # replicated
    ROWS_BY_HEAD = 1  # outer rows, head_dim rows per head
    ROWS_BY_GROUP = 2  # outer rows, o_lora_rank rows per output group
    SINKS_BY_HEAD = 3  # a 1-D vector, one entry per head
    COLS_BY_GROUP = 4  # the inner axis, o_lora_rank columns per output group
    EXPERTS = 5  # the outermost axis of a 3-D expert tensor
    VOCAB_ROWS = 6  # outer rows of the output head
    RANK0_ONLY = 7  # the shared expert


_SPLIT_BY_SUFFIX = {
    "attn_q_b.weight": Split.ROWS_BY_HEAD,
    "attn_sinks.weight": Split.SINKS_BY_HEAD,
    "attn_output_a.weight": Split.ROWS_BY_GROUP,
    "attn_output_b.weight": Split.COLS_BY_GROUP,
    "ffn_gate_exps.weight": Split.EXPERTS,
    "ffn_up_exps.weight": Split.EXPERTS,
    "ffn_down_exps.weight": Split.EXPERTS,
    "ffn_gate_shexp.weight": Split.RANK0_ONLY,
    "ffn_up_shexp.weight": Split.RANK0_ONLY,
    "ffn_down_shexp.weight": Split.RANK0_ONLY,
}


def split_of(name: str) -> Split:
    """How the tensor `name` is split (the indexer's own q_b is replicated, not a head split)."""
    if name == "output.weight":
        return Split.VOCAB_ROWS
    if name.startswith("blk.") and ".indexer" not in name:
        return _SPLIT_BY_SUFFIX.get(name.split(".", 2)[2], Split.WHOLE)
    return Split.WHOLE


@dataclass(frozen=True)
class RankPart:
    n_rank: int
    rank: int
    heads: range
    groups: range
    experts: range
    vocab: range

    @property
    def shared_expert(self) -> bool:
        return self.rank == 0

    @classmethod
    def of(cls, cfg: ModelConfig, n_rank: int, rank: int) -> "RankPart":
        """Rank `rank` of n_rank; ConfigError naming the dimension that does not split."""
        if n_rank < 1 or not 0 <= rank < n_rank:
            raise ValueError(f"rank: expected 0..{n_rank - 1}, got {rank}")
        for what, value in (("head_count", cfg.n_head), ("attention.output_group_count", cfg.o_groups),
                            ("expert_count", cfg.n_expert)):
            if value % n_rank:
                raise ConfigError(f"tensor parallel over {n_rank} ranks: {what} must be a multiple "
                                  f"of {n_rank}, got {value}")
        return cls(n_rank, rank, part_range(cfg.n_head, n_rank, rank),
                   part_range(cfg.o_groups, n_rank, rank), part_range(cfg.n_expert, n_rank, rank),
                   part_range(cfg.n_vocab, n_rank, rank))

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's backend computes with: its own heads and output groups."""
        return dataclasses.replace(cfg, n_head=len(self.heads), o_groups=len(self.groups))

    def holds(self, name: str) -> bool:
        return split_of(name) != Split.RANK0_ONLY or self.shared_expert

    def slice(self, t: Tensor, cfg: ModelConfig) -> Tensor:
        """This rank's part of tensor t (a view where the part is contiguous in the file, a copy
        of the block-aligned row slices for a column split). ConfigError names a column split
        that would cut a quantization block."""
        how = split_of(t.name)
        if how == Split.WHOLE or self.n_rank == 1:
            return t
        if how == Split.RANK0_ONLY:
            if self.shared_expert:
                return t
            raise ValueError(f"{t.name}: rank {self.rank} does not hold the shared expert")
        if how == Split.EXPERTS:
            return _outer(t, self.experts)
        if how == Split.VOCAB_ROWS:
            return _outer(t, self.vocab)
        if how == Split.ROWS_BY_HEAD:
            return _outer(t, _scaled(self.heads, cfg.head_dim))
        if how == Split.ROWS_BY_GROUP:
            return _outer(t, _scaled(self.groups, cfg.o_lora_rank))
        if how == Split.SINKS_BY_HEAD:
            return _inner(t, self.heads)
        return _inner(t, _scaled(self.groups, cfg.o_lora_rank))  # COLS_BY_GROUP


def _scaled(r: range, unit: int) -> range:
    return range(r.start * unit, r.stop * unit)


def _flat(x):
    """A contiguous flat copy of a numpy array or a torch tensor (the cut runs on either)."""
    return np.ascontiguousarray(x).reshape(-1) if isinstance(x, np.ndarray) else x.contiguous().reshape(-1)


def _outer(t: Tensor, part: range) -> Tensor:
    """Slice the outermost axis (GGUF dims[-1]): whole rows or whole experts, contiguous bytes."""
    outer = t.dims[-1]
    if part.stop > outer:
        raise ValueError(f"{t.name}: part {part.start}:{part.stop} is past its {outer} entries")
    per = t.raw.size // outer
    b0, b1 = part.start * per, part.stop * per

    def cut(raw):
        return raw.reshape(-1)[b0:b1]

    return Tensor(t.name, t.type, (*t.dims[:-1], len(part)), cut(t.raw), whole=t, cut=cut)


def _inner(t: Tensor, part: range) -> Tensor:
    """Slice the innermost axis (GGUF dims[0]) of every row: the block-aligned byte range of
    each row, copied into one contiguous array."""
    f = block_format(t.type)
    if part.start % f.block_values or part.stop % f.block_values:
        raise ConfigError(f"{t.name}: tensor parallel cuts its rows at values {part.start}:"
                          f"{part.stop}, not on its {f.name} blocks of {f.block_values} values")
    rb = t.row_bytes
    b0 = row_bytes(t.type, part.start) if part.start else 0
    b1 = row_bytes(t.type, part.stop)

    def cut(raw):
        return _flat(raw.reshape(-1, rb)[:, b0:b1])

    return Tensor(t.name, t.type, (len(part), *t.dims[1:]), cut(t.raw), whole=t, cut=cut)
