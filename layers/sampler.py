"""Batched token sampling on the logits' device (rank 0), from tensors: no request objects, no host sync.

Per row: a temperature (0 = greedy: the argmax), top_k (0 = off; past the vocabulary = off) and top_p (1 = off).
Sampled rows apply temperature, then top-k and top-p on the sorted distribution, then the exponential-race trick:
argmax(p / E) with E ~ Exp(1) i.i.d. draws exactly from p. A row given its own torch.Generator (a seeded request)
draws its noise from it alone, so its tokens depend only on its seed and its own logits, never on what else shares
the batch; the other rows share the sampler's generator (seeded by the engine seed). Padded vocabulary columns
(ids past the tokenizer's) are never sampled, and suppressed (row, id) pairs (stop ids before min_tokens) neither.

Values come validated (scheduler/sampling_params.py); still, suppress ids outside the logits and top-k past the
vocabulary are tolerated rather than trusted: an out-of-range index on a GPU is a device-side assert that kills the
whole process, not an exception.
"""
from __future__ import annotations

from typing import Sequence

import torch


class Sampler:
    def __init__(self, num_real_tokens: int, device: torch.device | str, seed: int = 0):
        self.num_real_tokens = num_real_tokens  # ids >= this are vocab padding with no token
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               generators: Sequence[tuple[int, torch.Generator]] = (),
               suppress: tuple[torch.Tensor, torch.Tensor] | None = None,
               greedy_only: bool = False, filtered: bool = True) -> torch.Tensor:
        """logits [B, vocab] (float32, on self.device; left as they are); temperature, top_k, top_p [B] float32.
        generators: (row, generator) of the rows with their own noise; suppress: (rows, ids) never to be sampled.
        greedy_only / filtered: what the caller knows on the host (every temperature is 0 / some row has top-k or
        top-p), so that no work and no sync is spent finding out. Returns [B] int64 token ids on the device."""
        V = self.num_real_tokens
        logits = logits[:, :V]  # a view: padding columns are out of every argmax below
        if suppress is not None and suppress[0].numel():
            rows, ids = suppress
            # a copy with one spare column, where ids past the logits land (they can never be sampled anyway):
            # a mask of the ids would cost a host sync
            masked = torch.empty(logits.shape[0], V + 1, dtype=logits.dtype, device=logits.device)
            masked[:, :V] = logits
            # index_fill_ takes the value as a kernel argument: an indexed assignment of a Python float copies it
            # to the device first, a synchronizing copy (caught on an H200 by torch's sync debug mode)
            masked.view(-1).index_fill_(0, rows * (V + 1) + ids.clamp(0, V), float("-inf"))
            logits = masked[:, :V]
        greedy = torch.argmax(logits, dim=-1)
        if greedy_only:
            return greedy
        # greedy rows (temperature 0) run the sampled path too, on temperature 1, and take the argmax in the end
        temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        if filtered:
            probs = self._top_k_top_p(probs, top_k, top_p)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in generators:
            noise[row].exponential_(generator=gen)
        # exponential_ may return 0 in float32; clamping keeps p/E finite without changing which p are 0
        sampled = torch.argmax(probs / noise.clamp_min_(1e-20), dim=-1)
        return torch.where(temperature > 0, sampled, greedy)

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        V = probs.shape[1]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        rank = torch.arange(V, device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k.clamp_max(V), V)  # top-k past the vocab = all
        drop = rank >= k[:, None]
        # top-p keeps the smallest prefix whose mass reaches top_p: drop a token when the mass before it already
        # reaches top_p (the first token is always kept); computed after top-k, on the top-k renormalised mass
        kept = sorted_p.masked_fill(drop, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        mass_before = torch.cumsum(kept, dim=-1) - kept
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)
