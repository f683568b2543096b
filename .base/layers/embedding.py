"""Vocabulary-parallel embedding and LM head: rank r holds rows [r*V/tp, (r+1)*V/tp) of the [V, H] tables.

Embedding: each rank looks up the ids it owns (zeros elsewhere) and an all-reduce completes the rows.
LM head: each rank computes its slice of the logits; the slices are gathered only for the tokens that need them,
and not at all for the engine's sampling, which works on each rank's slice (layers/sampler.py sample_fast).
"""
import torch
import torch.nn.functional as F
from torch import nn

from dist import parallel
from layers import backend
from layers.linear import even_split, linear_fast, linear_torch, make_param


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=None, device=None):
        super().__init__()
        self.start, self.size = even_split(vocab_size, parallel.tp_rank(), parallel.tp_size())
        self.weight = make_param((vocab_size, hidden_size), [[(self.start, self.size)], None], dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel.tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.size)
        out = F.embedding(local.clamp(0, self.size - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return parallel.all_reduce(out)


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=None, device=None):
        super().__init__()
        start, size = even_split(vocab_size, parallel.tp_rank(), parallel.tp_size())
        self.weight = make_param((vocab_size, hidden_size), [[(start, size)], None], dtype, device)
        self._linear = linear_fast if backend.use_fast() else linear_torch  # (the GEMV at 1-2 rows: 227 us / 245)

    def forward(self, hidden: torch.Tensor, gather: str = "driver") -> torch.Tensor | None:
        """Logits (float32): gather "driver" [n, V] on rank 0 (None on the others), "all" [n, V] on every rank,
        "none" this rank's vocabulary slice [n, V / tp] on every rank."""
        local = self._linear(hidden, self.weight).float()
        if gather == "none":
            return local
        if gather == "all":
            return parallel.all_gather_last_dim(local)
        if gather == "driver":
            return parallel.gather_last_dim_to_driver(local)
        raise ValueError(f"gather must be driver, all or none; got {gather!r}")
