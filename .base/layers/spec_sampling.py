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

from dist import parallel
from layers import backend
from layers.backend import pdl, prior_done, tl, triton
from layers.sampler import BLOCK, MAX_IDS, SampleBatch, gumbel_scores, masses, row_seeds, vocab_shard

if triton is not None:
    from layers.sampler import log_noise_k, seeds_k

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


def _accepted(ok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """[B] the drafts accepted per row: the length of the prefix of `ok` [B, k] among the row's drafts."""
    return (ok & _drafted(drafts, num_drafts)).to(torch.int64).cumprod(dim=1).sum(dim=1)


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
    return _emit(target, _accepted(drafts == target[:, :k], drafts, num_drafts))


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
    accepted = _accepted(u[:, :k] * draft_probs.gather(2, d)[..., 0] < p[:, :k].gather(2, d)[..., 0], drafts,
                         num_drafts)
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


# ----------------------------------------------------------------------------- on vocabulary shards (the engine's)
# The engine drafts and verifies from each rank's vocabulary shard of the logits ([rows, n] float32 columns
# start .. start + n - 1 of the padded vocabulary). Between a draft and its verification a slot keeps, per draft,
# the shard of the draft logits (raw: the filters and the temperature are applied again, the same way) and the
# log-sum-exp of the x they were drawn from; q(v) = exp(x_v - lse). Two implementations, same signature:
#   draft_torch / verify_torch  the reference: gather the whole rows, then draft_sample / verify above;
#   draft_fast / verify_fast    vocab-parallel: Triton passes over the shard (a row's max, first argmax,
#                               sum of exp, Gumbel candidates; the residual's candidates) and an all-gather of a
#                               few floats per row (parallel.all_gather: inside a CUDA graph, no NCCL call).
#                               Rows with top-k / top-p go the reference way (their steps run eagerly anyway).
# They draw the same tokens but for float rounding: the fast path's exp and log-sum-exp are Triton's and summed
# per block, so p and q differ from the reference's in the last bits, and a draw whose acceptance uniform falls
# within those bits of p/q (probability ~1e-7) may go the other way. Either path is exact in distribution.
STATS = 6     # per row and block: max x, its first id, sum exp(x - max x), best Gumbel score, its first id, and
#               the log of the row's acceptance noise (E at ACCEPT_ID: the uniform u = exp(-E), as verify_sampled)
RESIDUAL = 5  # per row and block: best residual score, its id, residual mass, best score of p itself, its id


class DraftDraw(NamedTuple):
    tokens: torch.Tensor  # [B] int64
    lse: torch.Tensor     # [B] float32: log-sum-exp of the row's x (sampled rows; 0 for greedy rows)


def _vocab(num_real_tokens: int, vocab_size: int) -> int:
    return min(num_real_tokens, vocab_size)


def draft_torch(logits: torch.Tensor, batch: SampleBatch | None, num_real_tokens: int,
                vocab_size: int) -> DraftDraw:
    """One draft per row from this rank's shard of the draft logits [B, n] (draft_sample on the gathered rows)."""
    full = parallel.all_gather_last_dim(logits)[:, :_vocab(num_real_tokens, vocab_size)]
    tokens, probs = draft_sample(full, batch)
    if probs is None:
        return DraftDraw(tokens, torch.zeros(full.shape[0], device=full.device))
    lse = torch.logsumexp(filtered_logits(full, batch), dim=-1)
    return DraftDraw(tokens, torch.where(batch.temperature > 0, lse, 0.0))


def verify_torch(logits: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, draft_lse: torch.Tensor,
                 batch: SampleBatch | None, num_drafts: torch.Tensor | None, num_real_tokens: int,
                 vocab_size: int) -> Verdict:
    """A verify step's emitted tokens from this rank's shards: logits [B, k + 1, n] (the target's), drafts [B, k],
    draft_logits [B, k, n] and draft_lse [B, k] (what the drafts were drawn from: DraftDraw), batch (None: every
    row greedy), num_drafts [B] (None: k each). verify on the gathered rows, q = exp(x - lse)."""
    B, T, n = logits.shape
    V = _vocab(num_real_tokens, vocab_size)
    full = parallel.all_gather_last_dim(logits.reshape(B * T, n))[:, :V].view(B, T, V)
    if batch is None or batch.greedy_only:
        return verify_greedy(full, drafts, num_drafts)
    k = T - 1
    xq = parallel.all_gather_last_dim(draft_logits.reshape(B * k, n))[:, :V]
    probs = torch.exp(filtered_logits(xq, at_positions(batch, k)) - draft_lse.reshape(B * k, 1)).view(B, k, V)
    return verify(full, drafts, probs, batch, num_drafts)


if triton is not None:
    @triton.jit
    def _stats_kernel(lg_ptr, stride, n_valid, start, id_offset, accept_id, inv_t_ptr, key_ptr, ctr_ptr, out_ptr,
                      nb, W: tl.constexpr, SAMPLED: tl.constexpr, ACCEPT: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, block): STATS of x = logit * inv_t over the block's valid columns (Gumbel scores with the
        noise of ids + id_offset at the row's key and counter, with SAMPLED; the acceptance noise with ACCEPT)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_valid
        x = tl.load(lg_ptr + row * stride + cols, mask=ok, other=float("-inf")) * tl.load(inv_t_ptr + row) + 0.0
        mx = tl.max(x, 0)
        out = out_ptr + (row * nb + blk) * W
        tl.store(out, mx)
        tl.store(out + 1, (blk * BLOCK + tl.argmax(x, 0, tie_break_left=True) + start).to(tl.float32))
        tl.store(out + 2, tl.sum(tl.where(ok, tl.exp(x - mx), 0.0), 0))
        if SAMPLED or ACCEPT:
            s1, s2 = seeds_k(tl.load(key_ptr + row), tl.load(ctr_ptr + row))
        if SAMPLED:
            sc = tl.where(ok, x - log_noise_k((cols + start + id_offset).to(tl.int64), s1, s2), float("-inf"))
            tl.store(out + 3, tl.max(sc, 0))
            tl.store(out + 4, (blk * BLOCK + tl.argmax(sc, 0, tie_break_left=True) + start).to(tl.float32))
        else:
            tl.store(out + 3, float("-inf"))
            tl.store(out + 4, 0.0)
        if ACCEPT:
            tl.store(out + 5, log_noise_k(s1 * 0 + accept_id, s1, s2))
        else:
            tl.store(out + 5, 0.0)

    @triton.jit
    def _residual_kernel(p_ptr, q_ptr, stride_p, stride_q, n_valid, start, inv_t_ptr, lse_p_ptr, lse_q_ptr,
                         key_ptr, ctr_ptr, out_ptr, nb, W: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, block): RESIDUAL over the block: r = max(0, p - q), p = exp(xp - lse_p), q likewise;
        scores log(r) - log(E) and xp - log(E) with the noise of the token ids at the row's key and counter."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_valid
        inv_t = tl.load(inv_t_ptr + row)
        xp = tl.load(p_ptr + row * stride_p + cols, mask=ok, other=float("-inf")) * inv_t + 0.0
        xq = tl.load(q_ptr + row * stride_q + cols, mask=ok, other=float("-inf")) * inv_t + 0.0
        s1, s2 = seeds_k(tl.load(key_ptr + row), tl.load(ctr_ptr + row))
        ln = log_noise_k((cols + start).to(tl.int64), s1, s2)
        r = tl.maximum(tl.exp(xp - tl.load(lse_p_ptr + row)) - tl.exp(xq - tl.load(lse_q_ptr + row)), 0.0)
        r = tl.where(ok, r, 0.0)
        rs = tl.where(r > 0, tl.log(tl.where(r > 0, r, 1.0)) - ln, float("-inf"))
        bs = tl.where(ok, xp - ln, float("-inf"))
        out = out_ptr + (row * nb + blk) * W
        tl.store(out, tl.max(rs, 0))
        tl.store(out + 1, (blk * BLOCK + tl.argmax(rs, 0, tie_break_left=True) + start).to(tl.float32))
        tl.store(out + 2, tl.sum(r, 0))
        tl.store(out + 3, tl.max(bs, 0))
        tl.store(out + 4, (blk * BLOCK + tl.argmax(bs, 0, tie_break_left=True) + start).to(tl.float32))


def _best(v: torch.Tensor, ids: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest value along `dim` and its id, the first (lowest block / rank: lowest id) at ties."""
    i = v.argmax(dim=dim, keepdim=True)
    return v.gather(dim, i).squeeze(dim), ids.gather(dim, i).squeeze(dim)


def _merge_sum(m: torch.Tensor, s: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of exp(x - max x) over parts along `dim`, from each part's own max and sum; empty parts (max -inf)
    add nothing."""
    M = m.amax(dim=dim, keepdim=True)
    return torch.where(m > float("-inf"), s * torch.exp(m - M), 0.0).sum(dim=dim)


def merge_stats(st: torch.Tensor, dim: int) -> torch.Tensor:
    """STATS of parts (blocks of a shard, or the ranks' shards) along `dim` -> STATS of the whole."""
    mx, am = _best(st[..., 0], st[..., 1], dim)
    s = _merge_sum(st[..., 0], st[..., 2], dim)
    sc, si = _best(st[..., 3], st[..., 4], dim)
    return torch.stack([mx, am, s, sc, si, st[..., 5].select(dim, 0)], dim=-1)  # (the same noise in every part)


def merge_residual(r: torch.Tensor, dim: int) -> torch.Tensor:
    rs, ri = _best(r[..., 0], r[..., 1], dim)
    bs, bi = _best(r[..., 3], r[..., 4], dim)
    return torch.stack([rs, ri, r[..., 2].sum(dim=dim), bs, bi], dim=-1)


def stats_torch(logits: torch.Tensor, n_valid: int, start: int, id_offset: int, inv_t: torch.Tensor,
                key: torch.Tensor, counter: torch.Tensor, sampled: bool, accept: bool = False) -> torch.Tensor:
    """[R, STATS] of a shard's rows [R, n] (columns past n_valid are padding): the twin of stats_fast."""
    R, n = logits.shape
    valid = torch.arange(n, device=logits.device) < n_valid
    x = (logits * inv_t[:, None] + 0.0).masked_fill(~valid, float("-inf"))
    out = torch.zeros(R, STATS, device=logits.device)
    out[:, 0], out[:, 1] = x.max(dim=-1).values, (torch.argmax(x, dim=-1) + start).float()
    out[:, 2] = torch.where(valid, torch.exp(x - out[:, :1]), 0.0).sum(dim=-1)
    out[:, 3] = float("-inf")
    s1, s2 = row_seeds(key, counter) if sampled or accept else (None, None)
    if sampled:
        sc = gumbel_scores(x, torch.arange(start, start + n, device=x.device) + id_offset, s1, s2)
        sc = sc.masked_fill(~valid, float("-inf"))
        out[:, 3], out[:, 4] = sc.max(dim=-1).values, (torch.argmax(sc, dim=-1) + start).float()
    if accept:
        accept_id = torch.full((1,), ACCEPT_ID, dtype=torch.int64, device=logits.device)
        out[:, 5] = -gumbel_scores(torch.zeros(R, 1, device=logits.device), accept_id, s1, s2)[:, 0]
    return out


def stats_fast(logits: torch.Tensor, n_valid: int, start: int, id_offset: int, inv_t: torch.Tensor,
               key: torch.Tensor, counter: torch.Tensor, sampled: bool, accept: bool = False) -> torch.Tensor:
    """stats_torch in one launch (one program per row and block of BLOCK columns), then the blocks merged."""
    R, n = logits.shape
    nb = max(1, triton.cdiv(n, BLOCK))
    out = torch.empty(R, nb, STATS, device=logits.device)
    if R:
        _stats_kernel[(R, nb)](logits, logits.stride(0), n_valid, start, id_offset, ACCEPT_ID, inv_t, key, counter,
                               out, nb, W=STATS, SAMPLED=sampled, ACCEPT=accept, BLOCK=BLOCK,
                               enable_fp_fusion=False, **pdl())
    return merge_stats(out, dim=1)


def residual_torch(p_logits: torch.Tensor, q_logits: torch.Tensor, n_valid: int, start: int, inv_t: torch.Tensor,
                   lse_p: torch.Tensor, lse_q: torch.Tensor, key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[R, RESIDUAL] of the rows [R, n] of the target's and the draft's logits: the twin of residual_fast."""
    R, n = p_logits.shape
    valid = torch.arange(n, device=p_logits.device) < n_valid
    xp = (p_logits * inv_t[:, None] + 0.0).masked_fill(~valid, float("-inf"))
    xq = (q_logits * inv_t[:, None] + 0.0).masked_fill(~valid, float("-inf"))
    r = (torch.exp(xp - lse_p[:, None]) - torch.exp(xq - lse_q[:, None])).clamp_min(0.0).masked_fill(~valid, 0.0)
    s1, s2 = row_seeds(key, counter)
    ids = torch.arange(start, start + n, device=xp.device)
    rs = gumbel_scores(torch.where(r > 0, r.log(), float("-inf")), ids, s1, s2)
    bs = gumbel_scores(xp, ids, s1, s2).masked_fill(~valid, float("-inf"))
    out = torch.empty(R, RESIDUAL, device=xp.device)
    out[:, 0], out[:, 1] = rs.max(dim=-1).values, (torch.argmax(rs, dim=-1) + start).float()
    out[:, 2] = r.sum(dim=-1)
    out[:, 3], out[:, 4] = bs.max(dim=-1).values, (torch.argmax(bs, dim=-1) + start).float()
    return out


def residual_fast(p_logits: torch.Tensor, q_logits: torch.Tensor, n_valid: int, start: int, inv_t: torch.Tensor,
                  lse_p: torch.Tensor, lse_q: torch.Tensor, key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    R, n = p_logits.shape
    nb = max(1, triton.cdiv(n, BLOCK))
    out = torch.empty(R, nb, RESIDUAL, device=p_logits.device)
    if R:
        _residual_kernel[(R, nb)](p_logits, q_logits, p_logits.stride(0), q_logits.stride(0), n_valid, start,
                                  inv_t, lse_p, lse_q, key, counter, out, nb, W=RESIDUAL, BLOCK=BLOCK,
                                  enable_fp_fusion=False, **pdl())
    return merge_residual(out, dim=1)


def _all(x: torch.Tensor, merge) -> torch.Tensor:
    """Every rank's per-row parts [R, c] -> the merged whole [R, c], the same on every rank."""
    return merge(parallel.all_gather(x.contiguous()), dim=0)


def _argmax_ids(logits: torch.Tensor, n_valid: int, start: int) -> torch.Tensor:
    """The rows' argmax over the whole vocabulary (the first at ties), from this rank's shard [R, n]."""
    ones = torch.ones(logits.shape[0], device=logits.device)
    st = stats_fast(logits, n_valid, start, 0, ones, ones.long(), ones.long(), False)
    return _all(st, merge_stats)[:, 1].to(torch.int64)


def _filtered(batch: SampleBatch | None) -> bool:
    return batch is not None and not batch.greedy_only and (batch.any_top_k or batch.any_top_p)


def draft_fast(logits: torch.Tensor, batch: SampleBatch | None, num_real_tokens: int, vocab_size: int) -> DraftDraw:
    """draft_torch from the shard: one pass and an all-gather of [B, STATS]."""
    if _filtered(batch):
        return draft_torch(logits, batch, num_real_tokens, vocab_size)
    B, n = logits.shape
    start, n_valid = vocab_shard(n, num_real_tokens, vocab_size, "speculative sampling")
    if batch is None or batch.greedy_only:
        return DraftDraw(_argmax_ids(logits, n_valid, start), torch.zeros(B, device=logits.device))
    _check(batch)
    st = _all(stats_fast(logits, n_valid, start, DRAFT_ID_OFFSET, batch.inv_temperature, batch.key, batch.counter,
                         True), merge_stats)
    sampled = batch.temperature > 0
    tokens = torch.where(sampled, st[:, 4], st[:, 1]).to(torch.int64)
    return DraftDraw(tokens, torch.where(sampled, st[:, 0] + st[:, 2].log(), 0.0))


def verify_fast(logits: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, draft_lse: torch.Tensor,
                batch: SampleBatch | None, num_drafts: torch.Tensor | None, num_real_tokens: int,
                vocab_size: int) -> Verdict:
    """verify_torch from the shards: a pass over the target's rows and an all-gather of [B * (k + 1), STATS + 2]
    (each position's argmax, log-sum-exp, and x of its draft under p and q), acceptance on [B, k], then at each
    row's first rejected (or bonus) position a residual pass and an all-gather of [B, RESIDUAL]."""
    if _filtered(batch):
        return verify_torch(logits, drafts, draft_logits, draft_lse, batch, num_drafts, num_real_tokens, vocab_size)
    B, T, n = logits.shape
    k = T - 1
    start, n_valid = vocab_shard(n, num_real_tokens, vocab_size, "speculative sampling")
    flat = logits.reshape(B * T, n)
    if batch is None or batch.greedy_only:
        target = _argmax_ids(flat, n_valid, start).view(B, T)
        return _emit(target, _accepted(drafts == target[:, :k], drafts, num_drafts))
    _check(batch)
    rows = at_positions(batch, T)
    inv_t = batch.inv_temperature
    # x of each draft under the target (at its position) and under q, on the rank whose shard holds it
    local = drafts - start
    own = (local >= 0) & (local < n_valid)
    at = local.clamp(0, n - 1)[..., None]
    xp_d = torch.where(own, logits[:, :k].gather(2, at)[..., 0] * inv_t[:, None] + 0.0, float("-inf"))
    xq_d = torch.where(own, draft_logits.gather(2, at)[..., 0] * inv_t[:, None] + 0.0, float("-inf"))
    st = stats_fast(flat, n_valid, start, 0, rows.inv_temperature, rows.key, rows.counter, False, accept=True)
    pad = torch.full((B, 1), float("-inf"), device=logits.device)
    mine = torch.cat([st, torch.cat([xp_d, pad], 1).view(B * T, 1), torch.cat([xq_d, pad], 1).view(B * T, 1)], 1)
    both = parallel.all_gather(mine)
    st = merge_stats(both[..., :STATS], dim=0).view(B, T, STATS)
    xp_d, xq_d = both[..., STATS].amax(dim=0).view(B, T)[:, :k], both[..., STATS + 1].amax(dim=0).view(B, T)[:, :k]
    target = st[..., 1].to(torch.int64)  # each position's argmax (greedy rows)
    lse_p = st[..., 0] + st[..., 2].log()
    # acceptance: u q(d) < p(d), u = exp(-E) from the acceptance id's noise (as verify_sampled)
    u = torch.exp(-torch.exp(st[..., 5]))[:, :k]
    accepted = _accepted(u * torch.exp(xq_d - draft_lse) < torch.exp(xp_d - lse_p[:, :k]), drafts, num_drafts)
    # the token at the first rejected position (the residual's draw) or after the last draft (p's)
    i = torch.arange(B, device=logits.device)
    j = accepted.clamp(max=max(k - 1, 0))
    q_rows = draft_logits[i, j] if k else logits[i, accepted]
    lse_q = draft_lse[i, j] if k else lse_p[i, accepted]
    res = _all(residual_fast(logits[i, accepted], q_rows, n_valid, start, inv_t, lse_p[i, accepted], lse_q,
                             batch.key, batch.counter + accepted), merge_residual)
    rejected = accepted < (k if num_drafts is None else num_drafts)
    last = torch.where(rejected & (res[:, 2] > 0), res[:, 1], res[:, 4]).to(torch.int64)
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1).scatter(1, accepted[:, None], last[:, None])
    greedy_acc = _accepted(drafts == target[:, :k], drafts, num_drafts)
    sampled = batch.temperature > 0
    acc = torch.where(sampled, accepted, greedy_acc)
    return _emit(torch.where(sampled[:, None], tokens, target), acc)


def bind_spec_sampling():
    """(draft, verify): the fast pair or the reference, by the kernel set (chosen once, as the sampler's)."""
    return (draft_fast, verify_fast) if backend.use_fast() else (draft_torch, verify_torch)
