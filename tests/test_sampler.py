"""Sampler: greedy, temperature / top-k / top-p on a known distribution, per-request seeds, vocab padding, min_tokens."""
import pytest
import torch

from layers.sampler import SampleRow, Sampler
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


def draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> dict[int, float]:
    s = Sampler(REAL, "cpu", seed=seed)
    return frequencies(s.sample(known_logits(n), [SampleRow(params)] * n))


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
    rows = [SampleRow(SamplingParams(temperature=0)) for _ in range(6)]
    rows[4] = SampleRow(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3))  # filters don't matter
    out = Sampler(REAL, "cpu").sample(logits, rows)
    assert out == logits[:, :REAL].argmax(-1).tolist()


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
    rows = ([SampleRow(SamplingParams(temperature=1.0, top_k=2))] * n
            + [SampleRow(SamplingParams(temperature=0.0))] * n
            + [SampleRow(SamplingParams(temperature=1.0, top_p=0.6))] * n)
    out = Sampler(REAL, "cpu").sample(known_logits(3 * n), rows)
    assert_close(frequencies(out[:n]), expected({0: 0.3, 1: 0.2}))
    assert set(out[n:2 * n]) == {IDS[0]}
    assert_close(frequencies(out[2 * n:]), expected({0: 0.3, 1: 0.2, 2: 0.15}))


def test_padding_ids_never_sampled():
    logits = torch.zeros(2000, V)
    logits[:, REAL:] = 30.0
    out = Sampler(REAL, "cpu").sample(logits, [SampleRow(SamplingParams(temperature=2.0))] * 2000)
    assert max(out) < REAL
    assert len(set(out)) > 500  # and the real ids are sampled roughly uniformly


def seeded_run(seed: int, companions: list[SampleRow], position: int, steps: int = 20) -> list[int]:
    """Tokens drawn for one seeded request over `steps` steps, sharing each step's batch with `companions`."""
    sampler = Sampler(REAL, "cpu", seed=99)
    me = SampleRow(SamplingParams(temperature=0.8, top_p=0.95, seed=seed), sampler.make_generator(seed))
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        base = torch.randn(V, generator=g)  # this request's logits: the same in every run
        rows = companions[:position] + [me] + companions[position:]
        logits = torch.randn(len(rows), V) * 3  # companions' logits differ from run to run
        logits[position] = base
        out.append(sampler.sample(logits, rows)[position])
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    alone = seeded_run(1234, [], 0)
    sampler = Sampler(REAL, "cpu")
    companions = [SampleRow(SamplingParams(temperature=1.0)),
                  SampleRow(SamplingParams(temperature=0.7, seed=1234), sampler.make_generator(1234)),
                  SampleRow(SamplingParams(temperature=0.0)),
                  SampleRow(SamplingParams(temperature=1.3, top_k=7, seed=5), sampler.make_generator(5))]
    assert seeded_run(1234, companions, 2) == alone
    assert seeded_run(1234, companions[:1], 1) == alone
    assert seeded_run(4321, companions, 0) != alone  # 20 draws over ~990 ids: a collision is ~impossible


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.zeros(50, V)
    rows = [SampleRow(SamplingParams(temperature=1.0))] * 50
    a = Sampler(REAL, "cpu", seed=7).sample(logits, rows)
    assert Sampler(REAL, "cpu", seed=7).sample(logits, rows) == a
    assert Sampler(REAL, "cpu", seed=8).sample(logits, rows) != a


def test_suppressed_ids_are_never_sampled():
    # min_tokens: the engine passes the stop ids as suppress_ids until enough tokens exist
    logits = known_logits(500)
    eos = [IDS[0], IDS[1]]
    logits[:, eos] = 40.0
    rows = [SampleRow(SamplingParams(temperature=1.0), suppress_ids=tuple(eos))] * 250 \
        + [SampleRow(SamplingParams(temperature=0.0), suppress_ids=tuple(eos))] * 250
    out = Sampler(REAL, "cpu").sample(logits, rows)
    assert not set(out) & set(eos)
    assert set(out[250:]) == {IDS[2]}  # greedy falls to the best allowed id
    free = Sampler(REAL, "cpu").sample(logits[:1], [SampleRow(SamplingParams(temperature=0.0))])
    assert free[0] in eos


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_returns_python_ints(temperature):
    out = Sampler(REAL, "cpu").sample(torch.randn(3, V), [SampleRow(SamplingParams(temperature=temperature))] * 3)
    assert all(type(t) is int and 0 <= t < REAL for t in out) and len(out) == 3


def test_out_of_range_temperature_is_rejected():
    for bad in (-0.5, float("nan"), float("inf"), 1e308):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=100).temperature == 100.0


# ---- edge values and the last line of defence ------------------------------------------------------------------

def test_near_zero_temperature_is_greedy():
    # logits / 1e-40 is inf in float32, and softmax of inf is NaN: below GREEDY_TEMPERATURE a row samples as greedy
    rows = [SampleRow(SamplingParams(temperature=t, seed=1)) for t in (1e-40, 1e-30, 1e-6, 0.0)]
    assert Sampler(REAL, "cpu").sample(known_logits(4), rows) == [IDS[0]] * 4
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy


def test_top_k_past_the_vocabulary_keeps_everything():
    params = SamplingParams(temperature=1.0)
    params.top_k = 2**63  # what validation lets through is bounded; the sampler still clamps to the vocabulary
    assert_close(draw(params), expected(dict(enumerate(PROBS))))


def test_suppress_ids_outside_the_logits_are_ignored():
    # a stop id past the vocabulary can never be sampled, so there is nothing to suppress (indexing it would fail,
    # and on a GPU that is a device-side assert that ends the process)
    rows = [SampleRow(SamplingParams(temperature=t), suppress_ids=(V + 5, IDS[0], 10**12)) for t in (0.0, 1.0)]
    out = Sampler(REAL, "cpu").sample(known_logits(2), rows)
    assert out[0] == IDS[1] and out[1] != IDS[0]


def test_sample_each_fails_only_the_broken_row():
    broken = SamplingParams(temperature=1.0, seed=3)
    broken.top_p = "0.9"  # past validation: sampling this row raises
    rows = [SampleRow(SamplingParams(temperature=0.0)), SampleRow(broken), SampleRow(SamplingParams(temperature=0.0))]
    out = Sampler(REAL, "cpu").sample_each(known_logits(3), rows)
    assert out[0] == out[2] == IDS[0] and isinstance(out[1], TypeError)
    ok = [SampleRow(SamplingParams(temperature=0.0))] * 2
    assert Sampler(REAL, "cpu").sample_each(known_logits(2), ok) == [IDS[0]] * 2


def test_integer_fields_are_bounded():
    for bad in (dict(top_k=2**63), dict(top_k=-1), dict(seed=2**64), dict(seed=-2**63 - 1), dict(max_tokens=2**63),
                dict(stop_token_ids=[-1]), dict(stop_token_ids=[2**63]), dict(stop_token_ids=[True]),
                dict(temperature=10**400), dict(top_p=None)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(seed=-2**63, top_k=2**63 - 1).seed == -2**63
