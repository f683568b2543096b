"""Speculative decoding's acceptance math (layers/spec_sampling.py): greedy verification is exact; rejection sampling
emits tokens distributed as the target's (chi-square tests at significance ALPHA over many seeded draws on a tiny
vocabulary, at temperature 1 and with top-k / top-p applied to the target); a position without a draft emits the
very token layers/sampler.py's sample_torch draws; seeded rows do not depend on what shares the batch.

The draws are seeded, so each test is deterministic: ALPHA is the chance that a correct implementation would have
failed it with these seeds. Each chi-square test has a negative control (a wrong q, or no rejection at all) that
the same statistic must reject at p < CONTROL_P, so that the tests can fail."""
import dataclasses

import pytest
import torch

from layers.sampler import SampleBatch, sample_torch
from layers.spec_sampling import (draft_sample, filtered_logits, verify, verify_greedy,
                                  verify_sampled)

ALPHA = 1e-3       # significance level of every chi-square test
CONTROL_P = 1e-9   # a broken procedure must be rejected at least this strongly
V = 8              # tiny vocabulary


def batch_of(n: int, temperature=1.0, top_k=0, top_p=1.0, key=1234, counter0=0, stride=1) -> SampleBatch:
    """n sampled rows, one seed, draw numbers counter0, counter0 + stride, ... (independent draws)."""
    f = lambda v: torch.full((n,), float(v))  # noqa: E731
    return SampleBatch(f(temperature), f(top_k), f(top_p), torch.full((n,), key, dtype=torch.int64),
                       counter0 + stride * torch.arange(n, dtype=torch.int64), None,
                       greedy_only=temperature == 0, any_top_k=top_k > 0, any_top_p=top_p < 1)


def p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the cells with expected probability > 0 (0.0 if a cell outside the
    support is not empty); observed / expected_probs may be [cells] or [groups, cells] (each group its own
    distribution, dfs summed)."""
    observed, expected_probs = observed.double().reshape(-1, observed.shape[-1]), expected_probs.double()
    expected_probs = expected_probs.reshape(-1, expected_probs.shape[-1])
    if (observed[expected_probs == 0] > 0).any():
        return 0.0  # a token outside the target's support
    n = observed.sum(dim=-1, keepdim=True)
    cells = expected_probs > 0
    exp = (n * expected_probs)[cells]
    assert exp.min() >= 5, "too few draws for the chi-square approximation"
    stat = ((observed[cells] - exp) ** 2 / exp).sum()
    df = cells.sum() - observed.shape[0]
    return torch.special.gammaincc(df / 2, stat / 2).item()


def keep_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """The target distribution written out directly: softmax(logits / T), top-k, then the smallest prefix (by
    probability) whose mass before the last token is below top_p of the kept mass, renormalised."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    ps, order = p.sort(descending=True)
    keep = torch.ones_like(ps, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1:
        kept = ps * keep
        keep &= (kept.cumsum(0) - kept) < top_p * kept.sum()
    out = torch.zeros_like(p)
    out[order[keep]] = ps[keep]
    return out / out.sum()


# -------------------------------------------------------------------------------------------------- greedy
def test_greedy_accepts_the_longest_matching_prefix_then_the_targets_token():
    gen = torch.Generator().manual_seed(0)
    B, k = 64, 3
    logits = torch.randn(B, k + 1, V, generator=gen)
    target = logits.argmax(-1)
    agree = torch.randint(0, k + 1, (B,), generator=gen)  # drafts right up to here, then wrong
    drafts = target[:, :k].clone()
    for b in range(B):
        for j in range(agree[b], k):
            drafts[b, j] = (target[b, j] + 1 + torch.randint(0, V - 1, (), generator=gen)) % V
    got = verify_greedy(logits, drafts)
    assert torch.equal(got.num_emitted, agree + 1)
    for b in range(B):
        a = agree[b]
        assert got.tokens[b, :a + 1].tolist() == target[b, :a + 1].tolist()
        assert (got.tokens[b, a + 1:] == -1).all()
    # fewer drafts in some rows: acceptance stops at the row's last draft, the next token is the target's
    num = torch.randint(0, k + 1, (B,), generator=gen)
    capped = verify_greedy(logits, drafts, num)
    assert torch.equal(capped.num_emitted, torch.minimum(agree, num) + 1)
    # ties go to the lowest id, as the sampler's argmax
    tie = torch.zeros(1, 2, V)
    tie[0, 0, [3, 5]] = 1.0
    assert verify_greedy(tie, torch.tensor([[5]])).tokens.tolist() == [[3, -1]]


def test_mixed_batch_verifies_greedy_rows_greedily():
    gen = torch.Generator().manual_seed(1)
    B, k = 32, 2
    logits = torch.randn(B, k + 1, V, generator=gen)
    batch = batch_of(B)
    batch.temperature[::2] = 0.0
    drafts, probs = [], []
    for j in range(k):
        t, q = draft_sample(logits[:, j] + torch.randn(B, V, generator=gen),
                            dataclasses.replace(batch, counter=batch.counter + j))
        drafts.append(t)
        probs.append(q)
    drafts, probs = torch.stack(drafts, 1), torch.stack(probs, 1)
    out = verify(logits, drafts, probs, batch)
    greedy = verify_greedy(logits, drafts)
    sampled = verify_sampled(logits, drafts, probs, batch)
    assert torch.equal(out.tokens[::2], greedy.tokens[::2]) and torch.equal(out.tokens[1::2], sampled.tokens[1::2])
    assert torch.equal(out.num_emitted[::2], greedy.num_emitted[::2])


# -------------------------------------------------------------------------------------------------- sampled
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.9)])
def test_no_draft_emits_the_samplers_token(temperature, top_k, top_p):
    """A position with no draft is the sampler's own draw: same noise, same keep set, same token."""
    gen = torch.Generator().manual_seed(2)
    B, vocab = 200, 300
    logits = torch.randn(B, vocab, generator=gen) * 3
    batch = batch_of(B, temperature, top_k, top_p, key=99, counter0=7)
    ref = sample_torch(logits, batch, vocab, vocab)
    out = verify_sampled(logits[:, None], torch.zeros(B, 0, dtype=torch.int64), torch.zeros(B, 0, vocab), batch)
    assert torch.equal(out.tokens[:, 0], ref) and (out.num_emitted == 1).all()
    # a draft at position 0 that is never accepted (num_drafts 0) changes nothing
    d, q = draft_sample(logits, batch)
    none = torch.zeros(B, dtype=torch.int64)
    capped = verify_sampled(torch.stack([logits, logits], 1), d[:, None], q[:, None], batch, none)
    assert torch.equal(capped.tokens[:, 0], ref)
    # the keep set is the sampler's: no sampled token ever falls outside it
    x = filtered_logits(logits, batch)
    assert torch.isfinite(x.gather(1, ref[:, None])).all()
    assert (torch.isfinite(x).sum(-1) <= (top_k or vocab)).all()


def first_token_counts(target_logits, draft_logits, batch, k):
    """Draw drafts from the fixed draft logits (one set per position), verify, and count each position's emitted
    token over the rows that reached it: [k + 1, V]."""
    B = batch.counter.shape[0]
    drafts, probs = [], []
    for j in range(k):
        t, q = draft_sample(draft_logits[j].expand(B, V), dataclasses.replace(batch, counter=batch.counter + j))
        drafts.append(t)
        probs.append(q)
    drafts, probs = torch.stack(drafts, 1), torch.stack(probs, 1)
    out = verify_sampled(target_logits.expand(B, k + 1, V), drafts, probs, batch)
    counts = torch.zeros(k + 1, V, dtype=torch.int64)
    for j in range(k + 1):
        reached = out.num_emitted > j
        counts[j] = torch.bincount(out.tokens[reached, j], minlength=V)
    return counts, out, drafts, probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.9)])
def test_emitted_tokens_follow_the_target_distribution(temperature, top_k, top_p):
    """Each position's emitted token (over the draws that reach it) follows the target's filtered distribution; the
    first draft's acceptance rate is sum(min(p, q)) within 4 standard errors."""
    gen = torch.Generator().manual_seed(3)
    k, n = 3, 40000
    target = torch.randn(k + 1, V, generator=gen) * 1.5
    draft = target[:k] + torch.randn(k, V, generator=gen)  # a draft model that is close, not equal
    batch = batch_of(n, temperature, top_k, top_p, key=5, stride=k + 1)
    counts, out, _, _ = first_token_counts(target, draft, batch, k)
    p = torch.stack([keep_probs(target[j], temperature, top_k, top_p) for j in range(k + 1)])
    for j in range(k + 1):
        assert p_value(counts[j], p[j]) > ALPHA, (j, counts[j], p[j])
    q0 = keep_probs(draft[0], temperature, top_k, top_p)
    rate = torch.minimum(p[0], q0).sum().item()
    got = (out.num_emitted > 1).double().mean().item()
    assert abs(got - rate) <= 4 * (rate * (1 - rate) / n) ** 0.5
    # control: taking the draft whenever it is drawn (no rejection) emits q, not p, and the test sees it
    wrong = torch.zeros(V, dtype=torch.int64)
    d0, _ = draft_sample(draft[0].expand(n, V), batch)
    wrong += torch.bincount(d0, minlength=V)
    assert p_value(wrong, p[0]) < CONTROL_P


def run_chains(P: torch.Tensor, Q: torch.Tensor, n_chains: int, steps: int, k: int, batch_kw: dict,
               wrong_q: bool = False) -> torch.Tensor:
    """Speculative decoding of a Markov chain: the target's logits for the next token are P[last], the draft's
    Q[last]. Each step drafts k tokens (each from Q of the previous draft), verifies them against P at the last
    token and each draft, and moves every chain's counter by its emitted tokens. Returns transition counts
    [V, V] (previous token, emitted token) over every emitted token. wrong_q: verify with a uniform q instead of
    the q the drafts came from (a broken verifier, for the control)."""
    gen = torch.Generator().manual_seed(11)
    last = torch.randint(0, V, (n_chains,), generator=gen)
    batch = batch_of(n_chains, key=0, **batch_kw)
    batch.key = torch.arange(n_chains, dtype=torch.int64) * 7919 + 3  # a seed per chain
    batch.counter = torch.zeros(n_chains, dtype=torch.int64)
    counts = torch.zeros(V, V, dtype=torch.int64)
    for _ in range(steps):
        drafts, probs, prev = [], [], last
        for j in range(k):
            t, q = draft_sample(Q[prev], dataclasses.replace(batch, counter=batch.counter + j))
            drafts.append(t)
            probs.append(torch.full_like(q, 1.0 / V) if wrong_q else q)
            prev = t
        drafts, probs = torch.stack(drafts, 1), torch.stack(probs, 1)
        context = torch.cat([last[:, None], drafts], 1)  # the token before each position
        out = verify_sampled(P[context], drafts, probs, batch)
        for j in range(k + 1):
            live = out.num_emitted > j
            before = context[live, j]  # the accepted prefix: drafts, so the context token is the emitted one
            counts.index_put_((before, out.tokens[live, j]), torch.ones_like(before), accumulate=True)
        last = out.tokens.gather(1, (out.num_emitted - 1)[:, None])[:, 0]
        batch.counter = batch.counter + out.num_emitted
    return counts


@pytest.mark.parametrize("batch_kw", [{}, {"top_k": 5}, {"top_p": 0.8}])
def test_speculative_chain_has_the_targets_transitions(batch_kw):
    """Many steps of drafting and verifying with the counters moving as an engine would move them: every transition
    (token -> next token) follows the target's distribution (a chi-square over all previous tokens at once)."""
    gen = torch.Generator().manual_seed(12)
    P = torch.randn(V, V, generator=gen)
    Q = P + torch.randn(V, V, generator=gen)
    expected = torch.stack([keep_probs(P[t], 1.0, batch_kw.get("top_k", 0), batch_kw.get("top_p", 1.0))
                            for t in range(V)])
    counts = run_chains(P, Q, n_chains=3000, steps=12, k=3, batch_kw=batch_kw)
    assert counts.sum() > 50000
    assert p_value(counts, expected) > ALPHA
    # control: a verifier that trusts a wrong q accepts the wrong tokens, and the same test rejects it
    wrong = run_chains(P, Q, n_chains=3000, steps=12, k=3, batch_kw=batch_kw, wrong_q=True)
    assert p_value(wrong, expected) < CONTROL_P


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(4)
    B, k = 24, 3
    target = torch.randn(B, k + 1, V, generator=gen)
    draft = torch.randn(B, k, V, generator=gen)
    batch = batch_of(B, 1.0, 4, 0.9, key=0)
    batch.key = torch.randint(0, 2**62, (B,), generator=gen)

    def run(order):
        b = dataclasses.replace(batch, key=batch.key[order], counter=batch.counter[order],
                                temperature=batch.temperature[order], top_k=batch.top_k[order],
                                top_p=batch.top_p[order])
        drafts, probs = zip(*(draft_sample(draft[order, j], dataclasses.replace(b, counter=b.counter + j))
                              for j in range(k)))
        return verify_sampled(target[order], torch.stack(drafts, 1), torch.stack(probs, 1), b)

    whole = run(torch.arange(B))
    perm = torch.randperm(B, generator=gen)
    shuffled = run(perm)
    assert torch.equal(shuffled.tokens, whole.tokens[perm]) and torch.equal(shuffled.num_emitted,
                                                                            whole.num_emitted[perm])
    alone = run(torch.tensor([5]))
    assert torch.equal(alone.tokens[0], whole.tokens[5])


def test_suppress_is_refused():
    batch = dataclasses.replace(batch_of(2), suppress=(torch.tensor([0]), torch.tensor([1])))
    with pytest.raises(ValueError, match="mask suppressed ids"):
        draft_sample(torch.zeros(2, V), batch)
