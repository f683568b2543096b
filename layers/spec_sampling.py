"""Speculative decoding's token math, exact: drawing drafts from a distribution q, and verifying a step's k drafts
against the target's logits so that the emitted tokens follow the distribution non-speculative sampling draws from
(Leviathan et al. 2023, Chen et al. 2023). Pure tensor functions over whole-vocabulary rows, batched over sequences.

Greedy rows (temperature 0): the drafts are accepted while each equals the target's argmax at its position (ties to
the lowest id, as layers/sampler.py), then the target's argmax at the first mismatch, or after the last draft (the
bonus token): exactly the tokens greedy decoding gives.

Sampled rows: p_j is the target's distribution at position j as layers/sampler.py samples it (logits / temperature,
the top-k then top-p keep set by the same rule, renormalised), q_j the distribution draft j was drawn from. Draft j
is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from
max(0, p_j - q_j) normalised; when every draft is accepted a bonus token is drawn from p_k. Each emitted token then
follows p given the tokens before it, whatever q is.

Noise is counter-based, as layers/sampler.py's: a row's key (its seed, or the engine's per request) and the draw
number of the output token a position stands for (position j of a step: `counter + j`), so a seeded request's
tokens depend on its seed, draw numbers and token ids alone. Three independent streams per (key, draw number), told
apart by the hashed id: a draft's Gumbel noise (token id + DRAFT_ID_OFFSET), the acceptance uniform (ACCEPT_ID),
and the residual's or bonus token's Gumbel noise (the token id itself: the noise sample_torch uses, so a position
with no draft emits sample_torch's token). A step that emits a + 1 tokens has used for them only the noise of draw
numbers counter .. counter + a; the next step starts at counter + a + 1, so no noise that decided an emitted token
is used again.

Suppressed ids (stop ids before min_tokens) depend on a position's draw number: the caller masks them (-inf) in the
logits of the positions they apply to; a SampleBatch with `suppress` set is refused. Logits cover the real vocabulary
only (the caller slices off padded columns).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from layers.sampler import MAX_IDS, SampleBatch, gumbel_scores, masses, row_seeds

DRAFT_ID_OFFSET = MAX_IDS  # a draft's noise for token id t hashes id t + DRAFT_ID_OFFSET (vocabularies are < MAX_IDS)
ACCEPT_ID = 2 * MAX_IDS    # the id whose noise gives a position's acceptance uniform


class Verdict(NamedTuple):
    tokens: torch.Tensor       # [B, k + 1] int64: the emitted tokens first (accepted drafts, then one more), -1 after
    num_emitted: torch.Tensor  # [B] int64: accepted drafts + 1


def _check(batch: SampleBatch) -> None:
    if batch.suppress is not None:
        raise ValueError("speculative sampling: mask suppressed ids in the logits of the positions they apply to "
                         "(a position's draw number decides them); SampleBatch.suppress is not supported here")


def filtered_logits(logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
    """logits [R, V] float32 -> x = logits / temperature (1 for greedy rows) with -inf outside the row's top-k then
    top-p keep set: the set and the values layers/sampler.py sample_torch draws among, by the same rule (sorted by x
    descending then id ascending; top-p by fixed-point masses)."""
    x = logits * batch.inv_temperature[:, None] + 0.0  # + 0.0: -0.0 becomes 0.0, as in sample_torch
    if batch.greedy_only or not (batch.any_top_k or batch.any_top_p):
        return x
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    keep = xs > float("-inf")
    if batch.any_top_k:
        keep &= torch.arange(x.shape[-1], device=x.device)[None, :] < batch.k_limit()[:, None]
    if batch.any_top_p:
        m = masses(xs - xs[:, :1], keep)  # (the row's max: what sample_torch subtracts)
        keep &= (torch.cumsum(m, dim=-1) - m) < batch.p_limit(m.sum(dim=-1))[:, None]
    return x.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), float("-inf"))


def at_positions(batch: SampleBatch, n: int) -> SampleBatch:
    """The rows of `batch` repeated for n positions each (row-major: [B * n]), position j at draw number counter + j."""
    def rep(t):
        return t.repeat_interleave(n)
    counter = rep(batch.counter) + torch.arange(n, device=batch.counter.device).repeat(batch.counter.shape[0])
    return dataclasses.replace(batch, temperature=rep(batch.temperature), top_k=rep(batch.top_k),
                               top_p=rep(batch.top_p), key=rep(batch.key), counter=counter)


def draft_sample(logits: torch.Tensor, batch: SampleBatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row from the draft model's logits [B, V] (float32): the argmax for greedy rows (batch None: all
    greedy), else a draw from q = softmax(filtered_logits) by Gumbel-max with the draft stream's noise at the row's
    draw number (batch.counter: the draw number of the output token the draft proposes). Returns tokens [B] int64
    and q [B, V] (one-hot at the argmax for greedy rows), or None when every row is greedy."""
    greedy = torch.argmax(logits, dim=-1)
    if batch is None or batch.greedy_only:
        return greedy, None
    _check(batch)
    x = filtered_logits(logits, batch)
    s1, s2 = row_seeds(batch.key, batch.counter)
    ids = torch.arange(x.shape[-1], device=x.device) + DRAFT_ID_OFFSET
    sampled = batch.temperature > 0
    tokens = torch.where(sampled, torch.argmax(gumbel_scores(x, ids, s1, s2), dim=-1), greedy)
    probs = torch.where(sampled[:, None], torch.softmax(x, dim=-1),
                        torch.nn.functional.one_hot(greedy, x.shape[-1]).to(x.dtype))
    return tokens, probs


def _drafted(drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """[B, k] bool: position j holds a draft of its row (j < num_drafts; every position when None)."""
    if num_drafts is None:
        return torch.ones_like(drafts, dtype=torch.bool)
    return torch.arange(drafts.shape[1], device=drafts.device)[None, :] < num_drafts[:, None]


def _emit(tokens: torch.Tensor, accepted: torch.Tensor) -> Verdict:
    after = torch.arange(tokens.shape[1], device=tokens.device)[None, :] > accepted[:, None]
    return Verdict(tokens.masked_fill(after, -1), accepted + 1)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> Verdict:
    """target_logits [B, k + 1, V] (position j: the target's logits for the token draft j proposes; position k: the
    bonus token's), drafts [B, k] int64, num_drafts [B] (rows with fewer drafts; None: k each). The longest prefix
    of drafts equal to the target's argmax, then the target's argmax."""
    target = torch.argmax(target_logits, dim=-1)
    k = drafts.shape[1]
    ok = (drafts == target[:, :k]) & _drafted(drafts, num_drafts)
    return _emit(target, ok.to(torch.int64).cumprod(dim=1).sum(dim=1))


def verify_sampled(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
                   batch: SampleBatch, num_drafts: torch.Tensor | None = None) -> Verdict:
    """Rejection sampling (module docstring) for every row as sampled: target_logits [B, k + 1, V] float32, drafts
    [B, k], draft_probs [B, k, V] (q of each draft), batch: the rows' settings, counter = the draw number of the
    output token position 0 stands for."""
    _check(batch)
    B, n, V = target_logits.shape
    k = n - 1
    rows = at_positions(batch, n)
    x = filtered_logits(target_logits.reshape(B * n, V), rows)
    p = torch.softmax(x, dim=-1).view(B, n, V)
    x = x.view(B, n, V)
    s1, s2 = row_seeds(rows.key, rows.counter)
    # E ~ Exp(1) from the acceptance id's Gumbel score g = -log E, then u = exp(-E) ~ U(0, 1): accept iff u q < p
    accept_id = torch.full((1,), ACCEPT_ID, dtype=torch.int64, device=x.device)  # (no host copy: CUDA graphs)
    g = gumbel_scores(torch.zeros(B * n, 1, device=x.device), accept_id, s1, s2)
    u = torch.exp(-torch.exp(-g)).view(B, n)
    s1, s2 = s1.view(B, n), s2.view(B, n)
    d = drafts[..., None]
    ok = (u[:, :k] * draft_probs.gather(2, d)[..., 0] < p[:, :k].gather(2, d)[..., 0]) & _drafted(drafts, num_drafts)
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    i = torch.arange(B, device=x.device)
    scores_x = x[i, accepted]  # the bonus token's: p itself
    if k:
        # rejected at `accepted` (fewer than the row's drafts were accepted): the residual max(0, p - q) instead
        rejected = accepted < (k if num_drafts is None else num_drafts)
        residual = (p[i, accepted] - draft_probs[i, accepted.clamp(max=k - 1)]).clamp_min(0)
        # (p(d) < q(d) makes the residual's mass positive; should rounding leave none, p itself)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[i, accepted])
        scores_x = torch.where(rejected[:, None], residual.log(), scores_x)
    last = torch.argmax(gumbel_scores(scores_x, torch.arange(V, device=x.device), s1[i, accepted], s2[i, accepted]),
                        dim=-1)
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1).scatter(1, accepted[:, None], last[:, None])
    return _emit(tokens, accepted)


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
           batch: SampleBatch | None, num_drafts: torch.Tensor | None = None) -> Verdict:
    """A verify step's emitted tokens: verify_greedy for greedy rows (batch None: every row), verify_sampled for
    rows with a temperature (their draft_probs from draft_sample)."""
    greedy = verify_greedy(target_logits, drafts, num_drafts)
    if batch is None or batch.greedy_only:
        return greedy
    sampled = verify_sampled(target_logits, drafts, draft_probs, batch, num_drafts)
    rows = batch.temperature > 0
    return Verdict(torch.where(rows[:, None], sampled.tokens, greedy.tokens),
                   torch.where(rows, sampled.num_emitted, greedy.num_emitted))
