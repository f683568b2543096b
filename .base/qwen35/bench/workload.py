"""Synthetic serving workloads: prompts and output lengths (shared by benchmarks/throughput.py and qwen35.bench).

Random weights never emit EOS, so a synthetic run must choose every request's output length (ignore_eos) and say
which. The standard, STANDARD_OUTPUT_LEN_DIST, is exponential with mean 290 tokens capped at the harness's 1024:
the users' real completions average about 290 tokens (derived from vLLM's published table), and the slowest
request of a level sets its wall time, so a fixed length would understate the tail. Fixed lengths are for labelled
extra rows only.

    fixed:N            every request N tokens
    uniform:A-B        uniform integers in [A, B]
    normal:MEAN,STD    rounded normal draws
    exp:MEAN,CAP       rounded exponential draws with mean MEAN, capped at CAP

Draws come from the caller's random.Random (seeded), are at least 1 token, and are the same for the same seed.
"""
from __future__ import annotations

import random

from qwen35.tokenizer import NUM_RANKS

STANDARD_OUTPUT_LEN_DIST = "exp:290,1024"
NUM_WARMUP = 2  # warm-up requests before each level's timed requests (the contract's harness)
FORMS = "fixed:N, uniform:A-B, normal:MEAN,STD or exp:MEAN,CAP"


def length_sampler(spec: str, rng: random.Random):
    """A function drawing one output length per call, for a spec of one of the forms above (ValueError if not)."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "fixed":
            n = int(arg)
            return lambda: n
        if kind == "uniform":
            lo, hi = (int(x) for x in arg.split("-"))
            return lambda: rng.randint(lo, hi)
        if kind == "normal":
            mean, std = (float(x) for x in arg.split(","))
            return lambda: round(rng.gauss(mean, std))
        if kind == "exp":
            mean, cap = arg.split(",")
            mean, cap = float(mean), int(cap)
            if mean > 0 and cap >= 1:
                return lambda: min(cap, round(rng.expovariate(1.0 / mean)))
    except ValueError:
        pass
    raise ValueError(f"output length distribution: expected {FORMS}, got {spec!r}")


def output_lengths(spec: str | None, n: int, default: int, rng: random.Random) -> list[int]:
    """n output lengths drawn from `spec` (None: all `default`), each at least 1."""
    if spec is None:
        return [default] * n
    draw = length_sampler(spec, rng)
    return [max(1, draw()) for _ in range(n)]


def random_prompt(counter, length: int, rng: random.Random) -> str:
    """Text of exactly `length` tokens, from consecutive vocabulary ids (decode/encode changes the count a little,
    so trim or extend with the next ids until it is stable). `counter.tok` is the tokenizer."""
    tok = counter.tok
    start = rng.randrange(0, NUM_RANKS - 4 * length)
    ids, nxt = list(range(start, start + length)), start + length
    for _ in range(50):
        text = tok.decode(ids)
        got = tok.encode(text)
        if len(got) == length:
            return text
        if len(got) > length:
            ids = got[:length]
        else:
            ids = got + list(range(nxt, nxt + length - len(got)))
            nxt += length - len(got)
    raise RuntimeError(f"could not build a {length}-token prompt from start id {start}")
