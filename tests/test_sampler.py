"""Sampler: greedy, temperature / top-k / top-p on a known distribution, per-request seeds, vocab padding, min_tokens.

The sampler takes tensors; `sample` below fills them from SamplingParams as the engine does (sampler_row), and
passes the host-side hints (greedy_only, filtered) as the engine computes them.
"""
import pytest
import torch

from layers.sampler import Sampler
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


def sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], generators=(),
           suppress: list[tuple[int, int]] = (), hints: bool = True) -> list[int]:
    """One token per row; generators: (row, torch.Generator); suppress: (row, token id) pairs. hints=False runs
    every path the hints let the engine skip."""
    t = torch.tensor([p.sampler_row() for p in params], dtype=torch.float32)
    sup = torch.tensor(list(suppress), dtype=torch.int64).reshape(-1, 2).T if suppress else None
    greedy_only = hints and all(p.greedy for p in params)
    filtered = not hints or any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params)
    out = sampler.sample(logits, t[:, 0], t[:, 1], t[:, 2], generators, None if sup is None else tuple(sup),
                         greedy_only, filtered)
    assert out.dtype == torch.int64 and out.shape == (logits.shape[0],)
    return out.tolist()


def draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> dict[int, float]:
    s = Sampler(REAL, "cpu", seed=seed)
    return frequencies(sample(s, known_logits(n), [params] * n))


def expected(weights: dict[int, float]) -> dict[int, float]:
    total = sum(weights.values())
    return {IDS[i]: w / total for i, w in weights.items()}


def assert_close(freq, want, tol=0.03):
    # 4000 draws: binomial std <= 0.008, so 0.03 is > 3.5 sigma
    assert set(freq) <= set(want), sorted(set(freq) - set(want))  # nothing outside the allowed set
    for t, p in want.items():
        assert abs(freq.get(t, 0.0) - p) < tol, (t, freq.get(t), p)


def test_greedy_is_argmax_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    logits[2, REAL + 3] = 100.0  # a padding id never wins, even in greedy
    rows = [SamplingParams(temperature=0) for _ in range(6)]
    rows[4] = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)  # filters don't matter
    before = logits.clone()
    for hints in (True, False):
        assert sample(Sampler(REAL, "cpu"), logits, rows, hints=hints) == logits[:, :REAL].argmax(-1).tolist()
    assert torch.equal(logits, before)  # the caller's logits are left as they are


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
    out = sample(Sampler(REAL, "cpu"), known_logits(3 * n), rows)
    assert_close(frequencies(out[:n]), expected({0: 0.3, 1: 0.2}))
    assert set(out[n:2 * n]) == {IDS[0]}
    assert_close(frequencies(out[2 * n:]), expected({0: 0.3, 1: 0.2, 2: 0.15}))


def test_padding_ids_never_sampled():
    logits = torch.zeros(2000, V)
    logits[:, REAL:] = 30.0
    out = sample(Sampler(REAL, "cpu"), logits, [SamplingParams(temperature=2.0)] * 2000)
    assert max(out) < REAL
    assert len(set(out)) > 500  # and the real ids are sampled roughly uniformly


def seeded_run(seed: int, companions: list[SamplingParams], position: int, steps: int = 20) -> list[int]:
    """Tokens drawn for one seeded request over `steps` steps, sharing each step's batch with `companions` (each
    with its own generator when it has a seed, as the engine gives them)."""
    sampler = Sampler(REAL, "cpu", seed=99)
    me = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    params = companions[:position] + [me] + companions[position:]
    gens = [(i, sampler.make_generator(p.seed)) for i, p in enumerate(params) if p.seed is not None]
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        base = torch.randn(V, generator=g)  # this request's logits: the same in every run
        logits = torch.randn(len(params), V) * 3  # companions' logits differ from run to run
        logits[position] = base
        out.append(sample(sampler, logits, params, gens)[position])
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
    a = sample(Sampler(REAL, "cpu", seed=7), logits, rows)
    assert sample(Sampler(REAL, "cpu", seed=7), logits, rows) == a
    assert sample(Sampler(REAL, "cpu", seed=8), logits, rows) != a


def test_suppressed_ids_are_never_sampled():
    # min_tokens: the engine passes the stop ids as suppress_ids until enough tokens exist
    logits = known_logits(500)
    eos = [IDS[0], IDS[1]]
    logits[:, eos] = 40.0
    rows = [SamplingParams(temperature=1.0)] * 250 + [SamplingParams(temperature=0.0)] * 250
    suppress = [(i, t) for i in range(500) for t in eos]
    out = sample(Sampler(REAL, "cpu"), logits, rows, suppress=suppress)
    assert not set(out) & set(eos)
    assert set(out[250:]) == {IDS[2]}  # greedy falls to the best allowed id
    assert sample(Sampler(REAL, "cpu"), logits[250:], rows[250:], suppress=suppress[:500]) == [IDS[2]] * 250
    free = sample(Sampler(REAL, "cpu"), logits[:1], [SamplingParams(temperature=0.0)])
    assert free[0] in eos  # only the rows named are suppressed, and the caller's logits are untouched


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_returns_token_ids_on_the_device(temperature):
    out = sample(Sampler(REAL, "cpu"), torch.randn(3, V), [SamplingParams(temperature=temperature)] * 3)
    assert all(0 <= t < REAL for t in out) and len(out) == 3


def test_hints_change_no_result():
    # greedy_only / filtered only let the engine skip work it knows is not needed: the full path gives the same ids
    logits = known_logits(64) + torch.randn(64, V)
    mixed = [SamplingParams(temperature=1.0, seed=i) for i in range(32)] + [SamplingParams()] * 32
    for params in (mixed, [SamplingParams()] * 64):
        runs = []
        for hints in (True, False):
            gens = [(i, torch.Generator().manual_seed(p.seed)) for i, p in enumerate(params) if p.seed is not None]
            runs.append(sample(Sampler(REAL, "cpu", seed=1), logits, params, gens, hints=hints))
        assert runs[0] == runs[1]


def test_out_of_range_temperature_is_rejected():
    for bad in (-0.5, float("nan"), float("inf"), 1e308):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=100).temperature == 100.0


# ---- edge values and the last line of defence ------------------------------------------------------------------

def test_near_zero_temperature_is_greedy():
    # logits / 1e-40 is inf in float32, and softmax of inf is NaN: below GREEDY_TEMPERATURE a row samples as greedy
    rows = [SamplingParams(temperature=t, seed=1) for t in (1e-40, 1e-30, 1e-6, 0.0)]
    assert sample(Sampler(REAL, "cpu"), known_logits(4), rows) == [IDS[0]] * 4
    assert [p.sampler_row()[0] for p in rows] == [0.0] * 4  # the sampler sees temperature 0: greedy
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy


def test_top_k_past_the_vocabulary_keeps_everything():
    params = SamplingParams(temperature=1.0)
    params.top_k = 2**63  # what validation lets through is bounded; the sampler still clamps to the vocabulary
    assert_close(draw(params), expected(dict(enumerate(PROBS))))


def test_suppress_ids_outside_the_logits_are_ignored():
    # a stop id past the vocabulary can never be sampled, so there is nothing to suppress (indexing it would fail,
    # and on a GPU that is a device-side assert that ends the process)
    rows = [SamplingParams(temperature=t) for t in (0.0, 1.0)]
    out = sample(Sampler(REAL, "cpu"), known_logits(2), rows,
                 suppress=[(r, t) for r in range(2) for t in (V + 5, IDS[0], 10**12)])
    assert out[0] == IDS[1] and out[1] != IDS[0]


def test_integer_fields_are_bounded():
    for bad in (dict(top_k=2**63), dict(top_k=-1), dict(seed=2**64), dict(seed=-2**63 - 1), dict(max_tokens=2**63),
                dict(stop_token_ids=[-1]), dict(stop_token_ids=[2**63]), dict(stop_token_ids=[True]),
                dict(temperature=10**400), dict(top_p=None)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(seed=-2**63, top_k=2**63 - 1).seed == -2**63
