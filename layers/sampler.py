"""Batched token sampling on the logits' device (rank 0).

Greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax. Sampled rows apply temperature, then top-k and
top-p on the sorted distribution, then the exponential-race trick: argmax(p / E) with E ~ Exp(1) i.i.d. draws
exactly from p. A seeded request draws its noise from its own torch.Generator, so its tokens depend only on its
seed and its own logits, never on what else shares the batch; unseeded rows share the sampler's generator (seeded
by the engine seed).

Requests are validated before they get here; still, `sample_each` is the step loop's last line of defence: a row
whose parameters make sampling raise fails alone (its exception comes back in its place) and the rest of the batch
is sampled. Out-of-vocabulary suppress ids and top-k past the vocabulary are tolerated rather than trusted: an
out-of-range index on a GPU is a device-side assert that kills the whole process, not an exception.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen35.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None  # per-request generator when params.seed is set
    suppress_ids: tuple[int, ...] = ()         # token ids that must not be sampled (stop ids before min_tokens)


class Sampler:
    def __init__(self, num_real_tokens: int, device: torch.device | str, seed: int = 0):
        self.num_real_tokens = num_real_tokens  # ids >= this are vocab padding with no token
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample_each(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int | Exception]:
        """sample(), except that a row whose sampling raises gets its exception in its place while the other rows
        still get their tokens: one request's parameters must never fail the batch. (Seeded rows retried alone may
        draw different noise than in the failed batch; this is an error path.)"""
        try:
            return self.sample(logits, rows)
        except Exception:
            pass
        out: list[int | Exception] = []
        for i, row in enumerate(rows):
            try:
                out.append(self.sample(logits[i:i + 1], [row])[0])
            except Exception as e:
                out.append(e)
        return out

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        """logits: float32 [B, vocab] on self.device; returns one token id per row."""
        B = logits.shape[0]
        assert B == len(rows), (B, len(rows))
        logits = logits.to(torch.float32, copy=True)  # masked in place below; the caller's tensor stays intact
        logits[:, self.num_real_tokens:] = float("-inf")
        # ids outside the logits can never be sampled anyway: leave them out rather than index past the end
        V = logits.shape[1]
        sup = [(i, t) for i, r in enumerate(rows) for t in r.suppress_ids if 0 <= t < V]
        if sup:
            sup_r, sup_c = zip(*sup)
            logits[torch.tensor(sup_r, device=logits.device), torch.tensor(sup_c, device=logits.device)] = float("-inf")

        out = torch.argmax(logits, dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            out[idx] = self._sample_rows(logits[idx], [rows[i] for i in sampled])
        return out.tolist()

    def _sample_rows(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev, dtype=torch.float32)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            probs = self._top_k_top_p(probs, top_k, top_p)
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            noise[shared] = torch.empty((len(shared), probs.shape[1]), device=dev).exponential_(
                generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        # exponential_ may return 0 in float32; clamping keeps p/E finite without changing which p are 0
        return torch.argmax(probs / noise.clamp_min_(1e-20), dim=-1)

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        dev = probs.device
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=dev)[None, :]
        V = probs.shape[1]
        k = torch.tensor([min(t, V) if t > 0 else V for t in top_k], device=dev)  # top-k past the vocab = all
        drop = rank >= k[:, None]
        # top-p keeps the smallest prefix whose mass reaches top_p: drop a token when the mass before it already
        # reaches top_p (the first token is always kept); computed after top-k, on the top-k renormalised mass
        kept = sorted_p.masked_fill(drop, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        mass_before = torch.cumsum(kept, dim=-1) - kept
        p = torch.tensor(top_p, device=dev, dtype=probs.dtype)
        drop |= mass_before >= p[:, None]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)
