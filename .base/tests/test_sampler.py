"""Sampler at TP=1: greedy, temperature / top-k / top-p on a known distribution, seeds, vocab padding, min_tokens;
the counter-based noise (the Triton shard pass computes the torch twin's bits), and sample_fast == sample_torch.

Statistics run on sample_torch (the reference); sample_fast, through Triton's interpreter on the CPU, is held to
the same tokens on smaller batches (and at TP=2 in tests/test_vocab_parallel_sampling.py).
"""
import math

import pytest
import torch

from layers.sampler import (SampleBatch, Sampler, SamplingStep, feed_tokens_fast, feed_tokens_torch, gumbel_scores,
                            masses, row_seeds, sample_fast, sample_torch, shard_pass_fast, shard_pass_torch,
                            stream_key)
from qwen35.sampling_params import SamplingParams

V = 1000        # vocab columns of the logits
REAL = 990      # ids >= REAL are padding
# a known distribution over 10 tokens placed at scattered ids (so sorting really has work to do)
PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.01, 0.01]
IDS = [503, 7, 911, 64, 250, 3, 777, 120, 640, 42]


def known_logits(n_rows: int) -> torch.Tensor:
    logits = torch.full((n_rows, V), -1e4)
    logits[:, IDS] = torch.log(torch.tensor(PROBS))
    logits[:, REAL:] = 50.0  # padding rows would win everything if they were ever considered
    return logits


def frequencies(tokens: list[int]) -> dict[int, float]:
    return {t: tokens.count(t) / len(tokens) for t in set(tokens)}


def make_batch(params: list[SamplingParams], engine_seed: int = 0, counters=None, suppress=(), hints=True,
               serial0: int = 0) -> SampleBatch:
    """The tensors the engine's Sampler gathers for these rows: a seeded row's key is its seed, an unseeded row's
    comes from the engine seed and its admission number (here its row + serial0). hints=False runs every path
    the hints let the engine skip."""
    t = torch.tensor([p.sampler_row() for p in params], dtype=torch.float32).reshape(-1, 3)
    keys = torch.tensor([stream_key(p.seed, engine_seed, serial0 + i) for i, p in enumerate(params)])
    ctr = torch.zeros(len(params), dtype=torch.int64) if counters is None else torch.as_tensor(counters)
    sup = None
    if suppress:
        sup = tuple(torch.tensor(list(suppress), dtype=torch.int64).T)
    return SampleBatch(t[:, 0], t[:, 1], t[:, 2], keys, ctr, sup,
                       greedy_only=hints and all(p.greedy for p in params),
                       any_top_k=not hints or any(not p.greedy and p.top_k > 0 for p in params),
                       any_top_p=not hints or any(not p.greedy and p.top_p < 1 for p in params))


def sample(logits, params, impl=sample_torch, real=REAL, **kw) -> list[int]:
    before = logits.clone()
    out = impl(logits, make_batch(params, **kw), real, logits.shape[1])
    assert out.dtype == torch.int64 and out.shape == (logits.shape[0],)
    assert torch.equal(logits, before)  # the caller's logits are left as they are
    return out.tolist()


def draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> dict[int, float]:
    return frequencies(sample(known_logits(n), [params] * n, engine_seed=seed))


def expected(weights: dict[int, float]) -> dict[int, float]:
    total = sum(weights.values())
    return {IDS[i]: w / total for i, w in weights.items()}


def assert_close(freq, want, tol=0.03):
    # 4000 draws: binomial std <= 0.008, so 0.03 is > 3.5 sigma
    assert set(freq) <= set(want), sorted(set(freq) - set(want))  # nothing outside the allowed set
    for t, p in want.items():
        assert abs(freq.get(t, 0.0) - p) < tol, (t, freq.get(t), p)


# ---- the reference's distributions ------------------------------------------------------------------------------

def test_greedy_is_argmax_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    logits[2, REAL + 3] = 100.0  # a padding id never wins, even in greedy
    logits[3, [10, 20]] = 9.0    # a tie: the lowest id, as torch.argmax
    rows = [SamplingParams(temperature=0) for _ in range(6)]
    rows[4] = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)  # filters don't matter
    want = logits[:, :REAL].argmax(-1).tolist()
    assert want[3] == 10
    for hints in (True, False):
        assert sample(logits, rows, hints=hints) == want


def test_temperature_one_samples_the_distribution():
    assert_close(draw(SamplingParams(temperature=1.0)), expected(dict(enumerate(PROBS))))


def test_temperature_sharpens():
    # T = 0.5 squares the probabilities before renormalising
    assert_close(draw(SamplingParams(temperature=0.5)), expected({i: p * p for i, p in enumerate(PROBS)}))


def test_top_k_samples_only_the_k_best():
    assert_close(draw(SamplingParams(temperature=1.0, top_k=3)), expected({0: 0.3, 1: 0.2, 2: 0.15}))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # cumulative mass 0.3, 0.5, 0.65, ...: top_p 0.45 keeps the first two, 0.6 the first three
    assert_close(draw(SamplingParams(temperature=1.0, top_p=0.45)), expected({0: 0.3, 1: 0.2}))
    assert_close(draw(SamplingParams(temperature=1.0, top_p=0.6)), expected({0: 0.3, 1: 0.2, 2: 0.15}))
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.01), n=500)) == {IDS[0]}


def test_top_k_then_top_p():
    # top_k 4 renormalises to 0.4, 0.267, 0.2, 0.133: top_p 0.55 then keeps 2 tokens (on the raw distribution,
    # whose mass before the third token is only 0.5, it would keep 3)
    assert_close(draw(SamplingParams(temperature=1.0, top_k=4, top_p=0.55)), expected({0: 0.3, 1: 0.2}))


def test_mixed_batch_rows_keep_their_own_settings():
    n = 3000
    rows = ([SamplingParams(temperature=1.0, top_k=2)] * n + [SamplingParams(temperature=0.0)] * n
            + [SamplingParams(temperature=1.0, top_p=0.6)] * n)
    out = sample(known_logits(3 * n), rows)
    assert_close(frequencies(out[:n]), expected({0: 0.3, 1: 0.2}))
    assert set(out[n:2 * n]) == {IDS[0]}
    assert_close(frequencies(out[2 * n:]), expected({0: 0.3, 1: 0.2, 2: 0.15}))


def test_padding_ids_never_sampled():
    logits = torch.zeros(2000, V)
    logits[:, REAL:] = 30.0
    out = sample(logits, [SamplingParams(temperature=2.0)] * 2000)
    assert max(out) < REAL
    assert len(set(out)) > 500  # and the real ids are sampled roughly uniformly


def test_ties_in_the_filters_keep_the_lowest_ids():
    # ten tokens of equal logit (the rest negligible): top-k 4 and top-p 0.35 (mass 0.1 each: 4 before reaching
    # it) both keep the 4 lowest ids of the tie, and draw them uniformly
    tied = [900, 12, 640, 33, 5, 871, 420, 77, 300, 150]
    logits = torch.full((2000, V), -1e4)
    logits[:, tied] = 3.0
    lowest = sorted(tied)[:4]
    for params in (SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=1.0, top_p=0.35)):
        assert_close(frequencies(sample(logits, [params] * 2000)), {t: 0.25 for t in lowest}, tol=0.04)


def seeded_run(seed: int, companions: list[SamplingParams], position: int, steps: int = 20) -> list[int]:
    """Tokens drawn for one seeded request over `steps` steps (its counter = the step), sharing each step's batch
    with `companions` (unseeded companions get admission numbers that differ from run to run)."""
    me = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    params = companions[:position] + [me] + companions[position:]
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        base = torch.randn(V, generator=g)  # this request's logits: the same in every run
        logits = torch.randn(len(params), V) * 3  # companions' logits differ from run to run
        logits[position] = base
        out.append(sample(logits, params, counters=[step] * len(params), serial0=len(companions))[position])
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    alone = seeded_run(1234, [], 0)
    companions = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=1234),
                  SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=7, seed=5)]
    assert seeded_run(1234, companions, 2) == alone
    assert seeded_run(1234, companions[:1], 1) == alone
    assert seeded_run(4321, companions, 0) != alone  # 20 draws over ~990 ids: a collision is ~impossible


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.zeros(50, V)
    rows = [SamplingParams(temperature=1.0)] * 50
    a = sample(logits, rows, engine_seed=7)
    assert sample(logits, rows, engine_seed=7) == a
    assert sample(logits, rows, engine_seed=8) != a
    assert len(set(a)) > 40  # and rows (admission numbers) draw apart


def test_counter_moves_the_noise():
    logits = torch.zeros(1, V)
    params = [SamplingParams(temperature=1.0, seed=3)]
    draws = [sample(logits, params, counters=[c])[0] for c in range(30)]
    assert len(set(draws)) > 25


def test_suppressed_ids_are_never_sampled():
    # min_tokens: the engine passes the stop ids as suppress_ids until enough tokens exist
    logits = known_logits(500)
    eos = [IDS[0], IDS[1]]
    logits[:, eos] = 40.0
    rows = [SamplingParams(temperature=1.0)] * 250 + [SamplingParams(temperature=0.0)] * 250
    suppress = [(i, t) for i in range(500) for t in eos]
    out = sample(logits, rows, suppress=suppress)
    assert not set(out) & set(eos)
    assert set(out[250:]) == {IDS[2]}  # greedy falls to the best allowed id
    assert sample(logits[250:], rows[250:], suppress=suppress[:500]) == [IDS[2]] * 250
    free = sample(logits[:1], [SamplingParams(temperature=0.0)])
    assert free[0] in eos  # only the rows named are suppressed


def test_hints_change_no_result():
    # greedy_only / any_top_k / any_top_p only let the engine skip work: the full path gives the same ids
    logits = known_logits(64) + torch.randn(64, V)
    mixed = [SamplingParams(temperature=1.0, seed=i) for i in range(32)] + [SamplingParams()] * 32
    for params in (mixed, [SamplingParams()] * 64):
        assert sample(logits, params, hints=True) == sample(logits, params, hints=False)


def test_near_zero_temperature_is_greedy():
    # logits / 1e-40 is inf in float32: below GREEDY_TEMPERATURE a row samples as greedy
    rows = [SamplingParams(temperature=t, seed=1) for t in (1e-40, 1e-30, 1e-6, 0.0)]
    assert sample(known_logits(4), rows) == [IDS[0]] * 4
    assert [p.sampler_row()[0] for p in rows] == [0.0] * 4  # the sampler sees temperature 0: greedy
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy


def test_top_k_past_the_vocabulary_keeps_everything():
    params = SamplingParams(temperature=1.0)
    params.top_k = 2**63  # what validation lets through is bounded; the sampler still keeps the whole vocabulary
    assert_close(draw(params), expected(dict(enumerate(PROBS))))


def test_suppress_ids_outside_the_logits_are_ignored():
    # a stop id past the vocabulary can never be sampled, so there is nothing to suppress (indexing it would fail,
    # and on a GPU that is a device-side assert that ends the process)
    rows = [SamplingParams(temperature=t) for t in (0.0, 1.0)]
    sup = [(r, t) for r in range(2) for t in (V + 5, IDS[0], 10**12, -3)]
    for impl in (sample_torch, sample_fast):
        out = sample(known_logits(2), rows, impl=impl, suppress=sup)
        assert out[0] == IDS[1] and out[1] != IDS[0]


def test_out_of_range_temperature_is_rejected():
    for bad in (-0.5, float("nan"), float("inf"), 1e308):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=100).temperature == 100.0


def test_integer_fields_are_bounded():
    for bad in (dict(top_k=2**63), dict(top_k=-1), dict(seed=2**64), dict(seed=-2**63 - 1), dict(max_tokens=2**63),
                dict(stop_token_ids=[-1]), dict(stop_token_ids=[2**63]), dict(stop_token_ids=[True]),
                dict(temperature=10**400), dict(top_p=None)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(seed=-2**63, top_k=2**63 - 1).seed == -2**63


# ---- the noise and the fixed-point masses -----------------------------------------------------------------------

def test_shard_pass_computes_the_torch_twins_bits():
    """The Triton pass (interpreter) and its torch twin agree bit for bit, at any shard offset, for keys and
    counters that use all 64 bits; the per-row candidates are the first maxima."""
    g = torch.Generator().manual_seed(0)
    B, n, start, n_valid = 3, 2500, 700, 2400
    lg = torch.randn(B, n, generator=g) * 3
    lg[1, [5, 1500]] = 20.0  # a greedy tie across blocks: the first
    inv_t = torch.tensor([1.0, 1 / 0.7, 2.0])
    key, ctr = torch.tensor([0, -5, 2**62 + 3]), torch.tensor([0, 7, 2**40 + 1])
    vals, ids, scores = shard_pass_fast(lg, n_valid, start, inv_t, key, ctr, sampled=True, write_scores=True)
    want = gumbel_scores(lg * inv_t[:, None], torch.arange(start, start + n), *row_seeds(key, ctr))
    want[:, n_valid:] = float("-inf")
    assert torch.equal(scores, want)
    assert ids[:, 1].tolist() == (want.argmax(1) + start).tolist()
    assert torch.equal(vals[:, 1], want.max(1).values)
    assert ids[:, 0].tolist() == (lg[:, :n_valid].argmax(1) + start).tolist() and ids[1, 0] == start + 5
    t_vals, t_ids, t_scores = shard_pass_torch(lg, n_valid, start, inv_t, key, ctr, sampled=True, write_scores=True)
    assert torch.equal(t_scores, scores) and torch.equal(t_vals, vals) and torch.equal(t_ids, ids)


def test_noise_is_gumbel():
    # x = 0 everywhere: the scores are i.i.d. Gumbel(0, 1): mean 0.5772, variance pi^2 / 6; exp(-G) ~ Exp(1)
    n = 400_000
    s = gumbel_scores(torch.zeros(1, n), torch.arange(n), *row_seeds(torch.tensor([11]), torch.tensor([2])))[0]
    s = s.double()
    assert abs(s.mean() - 0.5772) < 0.01 and abs(s.var() - math.pi ** 2 / 6) < 0.02
    e = torch.exp(-s)
    for q in (0.001, 0.01, 0.1, 0.5, 2.0):  # the small E (the winners) matter most
        assert abs((e < q).double().mean() - (1 - math.exp(-q))) < 4 * math.sqrt((1 - math.exp(-q)) / n) + 1e-4


def test_masses_are_exp_in_fixed_point():
    d = -torch.linspace(0, 40, 100_001)
    m = masses(d, torch.ones_like(d, dtype=torch.bool)).double()
    want = torch.exp(d.double()) * 2.0 ** 40
    assert m[0] == 2**40
    assert ((m - want).abs() <= want * 3e-7 + 1).all()  # float32 accuracy, then the floor
    assert (masses(d, torch.zeros_like(d, dtype=torch.bool)) == 0).all()


# ---- the CPU draw: exact scores only where they could win ---------------------------------------------------------

M32 = (1 << 32) - 1


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _unmix32_int(y: int) -> int:
    """The inverse of _mix32 (each step undone in reverse order)."""
    y ^= y >> 16
    y = (y * pow(0x846CA68B, -1, 1 << 32)) & M32
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 1 << 32)) & M32
    return y ^ (y >> 16)


def seeds_hashing_to(s1: int, token: int, hashes: list[int]) -> torch.Tensor:
    """s2 per row such that token's hash under (s1, s2) is the given 32-bit value: the noise's extremes on demand."""
    assert all(_mix32_int(_unmix32_int(h)) == h for h in hashes)
    return torch.tensor([_mix32_int(token ^ s1) ^ _unmix32_int(h) for h in hashes])


EXTREME_HASHES = [0, 1, 2, 3, 255, 1 << 20, (1 << 31) - 1, 1 << 31, M32 - 256, M32 - 1, M32]


def test_score_bounds_hold_at_every_hash():
    """The CPU draw's bounds (_ScoreBounds) over 2.4 M scores, rows of every temperature, and at the hashes of the
    noise's extremes (the smallest E, so the largest scores, and the largest): no score above its bound by more than
    BOUND_ERR (plus 2^-20 of its size), none below it by SCORE_GAP or more; both limits come close to binding."""
    from layers.sampler import BOUND_ERR, SCORE_GAP, _ScoreBounds
    g = torch.Generator().manual_seed(5)
    B, n = 8, 300_000
    lg = torch.randn(B, n, generator=g) * 4
    inv_t = torch.tensor([1.0, 1 / 0.7, 2.0, 0.1, 10.0, 1.0, 1.0, 1 / 1.3])
    s1, s2 = row_seeds(torch.randint(0, 2**62, (B,), generator=g), torch.arange(B) * 1000)
    token = 12345
    s1x = torch.full((len(EXTREME_HASHES),), 77)
    s2x = seeds_hashing_to(77, token, EXTREME_HASHES)
    for lg, inv_t, s1, s2 in ((lg, inv_t, s1, s2), (lg[:1].expand(len(EXTREME_HASHES), n), torch.ones(11), s1x, s2x)):
        ids = torch.arange(n)
        exact = gumbel_scores(lg * inv_t[:, None] + 0.0, ids, s1, s2)
        bound = _ScoreBounds(s1, s2, n)(lg, inv_t, ids.int(), torch.empty(lg.shape))
        over = exact - bound
        assert (over <= BOUND_ERR + bound.abs() * 2 ** -20).all() and (-over < SCORE_GAP).all()
    assert -over[:, token].min() > 2.7 and over.max() > -1e-3  # the largest hash; the linear log2's exact points
    h = _mix32_int(_mix32_int(token ^ 77) ^ int(s2x[0]))
    assert h == 0 and exact[0, token] - lg[0, token] > 22.8  # the largest noise there is


def test_gumbel_argmax_is_the_full_scores_argmax():
    """The CPU draw picks the token of the whole-row scores' argmax (the first maximum; 0 for a row with nothing
    to keep), over vocabularies of many chunks: spread, flat and peaked rows, -inf columns and rows, keep masks
    (an empty one included), the noise's extreme hashes on near-winners, a winner whose bound is not the best, and
    an exact tie between two tokens."""
    from layers.sampler import gumbel_argmax
    g = torch.Generator().manual_seed(1)

    def check(lg, inv_t, s1, s2, keep=None, chunk=256):
        scores = gumbel_scores(lg * inv_t[:, None] + 0.0, torch.arange(lg.shape[1]), s1, s2)
        want = (scores if keep is None else scores.masked_fill(~keep, float("-inf"))).argmax(dim=-1)
        got = gumbel_argmax(lg, inv_t, s1, s2, keep, chunk=chunk)
        assert torch.equal(got, want), (got, want)
        return got

    for trial in range(12):
        B, n = 1 + trial % 5, 700 + 911 * trial
        lg = [torch.randn(B, n, generator=g) * 3, torch.randn(B, n, generator=g) * 0.01,
              torch.randn(B, n, generator=g)][trial % 3]
        if trial % 4 == 3:
            lg[:, :20] += 15  # peaked
        if trial % 6 == 5:
            lg[:, n // 3:] = float("-inf")
            lg[-1] = float("-inf")
        inv_t = torch.rand(B, generator=g) * 3 + 0.1
        s1, s2 = row_seeds(torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 9, (B,), generator=g))
        keep = torch.rand(B, n, generator=g) < 0.4 if trial % 2 else None
        if keep is not None:
            keep[0] = False
        got = check(lg, inv_t, s1, s2, keep, chunk=[64, 256, 4096][trial % 3])
        if keep is not None or trial % 6 == 5:
            assert got[0 if keep is not None else -1] == 0  # nothing to keep
    # the extreme hashes on the token that (nearly) wins: E's smallest and largest values
    n, token = 3000, 1234
    s1 = torch.full((len(EXTREME_HASHES),), 77)
    s2 = seeds_hashing_to(77, token, EXTREME_HASHES)
    for lift in (-22.9, -22.0, 0.0, 2.8, 3.5):
        lg = torch.randn(len(EXTREME_HASHES), n, generator=g)
        lg[:, token] = lg.max() + lift
        check(lg, torch.ones(len(EXTREME_HASHES)), s1, s2)
    # the token with the best bound loses: at the largest hash its bound lies 2.8 above its score, and another's
    # score beats it by 0.5
    s2 = seeds_hashing_to(77, token, [M32])
    noise = gumbel_scores(torch.zeros(1, n), torch.arange(n), s1[:1], s2)[0]
    lg = torch.full((1, n), float("-inf"))
    lg[0, token], lg[0, 2000] = 0.0, noise[token] + 0.5 - noise[2000]
    assert check(lg, torch.ones(1), s1[:1], s2).item() == 2000
    # an exact tie between two tokens' scores: the lower id wins
    s1, s2 = row_seeds(torch.tensor([9]), torch.tensor([0]))
    g0 = gumbel_scores(torch.zeros(1, n), torch.arange(n), s1, s2)[0]
    lo, hi = 700, next(j for j in range(701, n) if _tie(g0, 700, j, s1, s2))
    lg = torch.full((1, n), float("-inf"))
    lg[0, hi], lg[0, lo] = 0.0, g0[hi] - g0[lo]
    assert check(lg, torch.ones(1), s1, s2).item() == lo


def _tie(g0, lo, hi, s1, s2) -> bool:
    """Whether x_lo = g_hi - g_lo (x_hi = 0) gives token lo exactly token hi's score."""
    x = torch.tensor([[g0[hi] - g0[lo]]])
    return bool(gumbel_scores(x, torch.tensor([lo]), s1, s2)[0, 0] == g0[hi])


# ---- sample_fast (one shard) == sample_torch ------------------------------------------------------------------

FAST_CASES = {
    "greedy": [SamplingParams()] * 4,
    "temperature": [SamplingParams(temperature=t, seed=s) for t, s in ((1.0, 1), (0.3, 2), (3.0, None), (0, None))],
    "top_k": [SamplingParams(temperature=1.0, top_k=k) for k in (1, 3, 50, 2000)],
    "top_p": [SamplingParams(temperature=t, top_p=p) for t, p in ((1.0, 0.2), (0.7, 0.9), (2.0, 0.999), (1.0, 1.0))],
    "both": [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in ((5, 0.5), (40, 0.95), (1, 0.1), (0, 0.6))],
}


@pytest.mark.parametrize("case", FAST_CASES)
def test_fast_equals_torch_on_one_shard(case):
    g = torch.Generator().manual_seed(len(case))
    params = FAST_CASES[case] * 4
    logits = torch.randn(len(params), V, generator=g) * 2
    logits[::2, 100:110] = 9.0   # the top ten tied (every other row): the filters' boundaries fall inside the tie
    logits[1::2, 100:110] = 2.0  # ties further down
    logits[:, REAL:] = 60.0      # padding never wins
    sup = [(i, t) for i in range(0, len(params), 3) for t in (100, 101, int(logits[i, :REAL].argmax()))]
    for kw in (dict(), dict(suppress=sup), dict(hints=False)):
        want = sample(logits, params, **kw)
        assert sample(logits, params, impl=sample_fast, **kw) == want, kw
        assert max(want) < REAL


# ---- the per-slot state and the message ------------------------------------------------------------------------

def test_sampling_step_round_trip():
    step = SamplingStep(False, True, False, [(3, (0.7, 50.0, 0.9), -2**63), (0, (0.0, 0.0, 1.0), 2**63 - 1)],
                        [(0, 248044), (2, 7)])
    back = SamplingStep.decode(step.encode())
    assert back.suppress == step.suppress and back.admitted[1] == step.admitted[1]
    slot, (t, k, p), key = back.admitted[0]
    assert (slot, k, key) == (3, 50.0, -2**63) and t == pytest.approx(0.7) and p == pytest.approx(0.9)
    assert (back.greedy_only, back.any_top_k, back.any_top_p) == (False, True, False)
    with pytest.raises(ValueError, match="sampling step"):
        SamplingStep.decode(step.encode()[:-1])


def test_sampler_slots_draw_their_own_streams():
    """A seeded request gets the same tokens in any slot, beside anything: its key is its seed and its counter
    counts its own draws (reset when its slot is admitted again)."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=42)
    step = lambda admitted: SamplingStep(False, False, False, admitted)  # noqa: E731

    def tokens(slot, others):
        s = Sampler(REAL, V, num_slots=6, device="cpu")
        rows = [(slot, seeded.sampler_row(), 42)] + [(o, (1.0, 0.0, 1.0), 1000 + o) for o in others]
        s.admit(step(rows))
        slots = torch.tensor([slot, *others])
        out = [s.sample(logits[:len(slots)], slots, step([]))[0].item() for _ in range(8)]
        assert s.draws[slot] == 8
        s.admit(step(rows[:1]))  # the slot admitted again: its counter starts over
        assert s.draws[slot] == 0 and s.sample(logits[:1], slots[:1], step([]))[0].item() == out[0]
        return out

    alone = tokens(0, [])
    assert tokens(4, [1, 2]) == alone
    assert len(set(alone)) > 1


def _feed_case(n: int, num_slots: int, device="cpu"):
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, 250_000, (n,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:n]
    inputs = torch.randint(0, 250_000, (num_slots,), generator=g)
    return tokens.to(device), slots.to(device), inputs.to(device)


@pytest.mark.parametrize("n", [0, 1, 5, 130])
def test_feed_tokens_fast_equals_torch(n):
    """The feed kernel (interpreter) writes each sampled token into its slot's input and into the host buffer, as
    the torch way does (index_put + copy); the other slots keep theirs; 130 rows take two programs."""
    tokens, slots, inputs = _feed_case(n, 300)
    want, got, got_no_host = inputs.clone(), inputs.clone(), inputs.clone()
    host_want, host_got = torch.full((n,), -1), torch.full((n,), -1)
    feed_tokens_torch(tokens, slots, want, host_want)
    feed_tokens_fast(tokens, slots, got, host_got)
    feed_tokens_fast(tokens, slots, got_no_host)
    assert torch.equal(got, want) and torch.equal(got_no_host, want)
    assert torch.equal(host_want, tokens) and torch.equal(host_got, tokens)
    assert (want != inputs).sum() <= n


def test_bind_feed_tokens_follows_the_kernel_set():
    """The runner binds the feed the kernel set names, as the layers bind theirs."""
    from layers import backend
    from layers.sampler import bind_feed_tokens
    for name, want in (("torch", feed_tokens_torch), ("fast", feed_tokens_fast)):
        with backend.use_kernels(name):
            assert bind_feed_tokens() is want


@pytest.mark.gpu
def test_gpu_feed_tokens_reach_pinned_host_memory():
    """On a GPU the feed kernel stores the tokens straight into pinned host memory (a view at an offset of a larger
    buffer, as the engine's are), readable once an event recorded behind it has completed; the slots' inputs on
    the device as the torch way leaves them, with or without the host buffer."""
    pinned = torch.full((300,), -1, dtype=torch.int64, pin_memory=True)
    for n in (1, 5, 64, 200):
        tokens, slots, inputs = _feed_case(n, 256, "cuda")
        want, got, got_no_host = inputs.clone(), inputs.clone(), inputs.clone()
        feed_tokens_torch(tokens, slots, want)
        host = pinned[100 - n % 7:][:n]
        feed_tokens_fast(tokens, slots, got, host)
        feed_tokens_fast(tokens, slots, got_no_host)  # (the other ranks' variant)
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()
        assert host.tolist() == tokens.tolist()
        assert torch.equal(got, want) and torch.equal(got_no_host, want)
