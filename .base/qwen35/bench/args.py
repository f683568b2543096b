"""The bench's flags (cli.py), and the comma lists they take."""
from __future__ import annotations

import argparse

from qwen35.bench import latency, workload

ENGINE_MODES = ("record", "static", "trace", "latency", "spec")
HARNESS_MODES = ("prefill", "decode", "mixed")


def ints(s: str) -> list[int]:
    """"1,8,64" -> [1, 8, 64] (empty items skipped: "" is no value at all)."""
    return [int(x) for x in s.split(",") if x]


def pairs(spec: str, sep: str) -> list[tuple[int, int]]:
    """"AxB,CxD" (sep "x") -> [(A, B), (C, D)]; anything else is a usage error."""
    out = [tuple(int(x) for x in item.split(sep)) for item in spec.split(",") if item]
    if not out or any(len(p) != 2 for p in out):
        raise SystemExit(f"expected A{sep}B[,A{sep}B...], got {spec!r}")
    return out


def add_bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mode", default="record,trace",
                    help="comma list of: record (decode + prefill rows of record), static, trace, latency, spec; or of "
                         "the create_engine traces prefill, decode, mixed (in a run of their own)")
    ap.add_argument("--context", type=int, default=1024, help="context of every sequence in the decode rows")
    ap.add_argument("--prefill-seqs", default="1,8,64", help="prompts per prefill row (of --input-len tokens)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--profile-steps", type=int, default=100,
                    help="decode steps timed per profiled batch size (cpu_ms: a request's one-off costs, joining the "
                         "decode batch, spread over this many steps as over a completion of that length)")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--cold-levels", default="64",
                    help="trace: concurrency levels also run on prompts never seen (comma list; empty: none)")
    ap.add_argument("--output-len-dist", default=workload.STANDARD_OUTPUT_LEN_DIST,
                    help=f"trace output lengths: {workload.FORMS} (default {workload.STANDARD_OUTPUT_LEN_DIST}, the "
                         "standard for synthetic weights)")
    ap.add_argument("--spec-ks", default="0,1,2,3,auto",
                    help="spec: the speculative_tokens settings timed per batch size (0: off; K; auto)")
    ap.add_argument("--spec-profile", default="",
                    help="spec: BATCH:K rows also run under torch.profiler, comma separated (rank 0's top kernels)")
    g = ap.add_argument_group("latency")
    g.add_argument("--latency-shapes", default=latency.DEFAULT_SHAPES, help="PROMPT:OUTPUT tokens, comma separated")
    g.add_argument("--latency-reps", type=int, default=3, help="runs per shape (the median is reported)")
    g.add_argument("--compare-hf", action="store_true",
                   help="also time transformers' generate on the same weights in the same run (TP=1)")
    g.add_argument("--hf-reps", type=int, default=1, help="transformers runs per shape (the median is reported)")
    g = ap.add_argument_group("create_engine traces (prefill, decode, mixed)")
    g.add_argument("--harness-prefill", default="1x2048,1x8192,8x2048,4x8192",
                   help="BATCHxLEN prompts per prefill call, comma separated")
    g.add_argument("--harness-decode-batches", default="1,8,32,64")
    g.add_argument("--harness-context", type=int, default=1024, help="tokens per request before the decode calls")
    g.add_argument("--harness-steps", type=int, default=64, help="decode calls timed per batch")
    g.add_argument("--mixed-requests", type=int, default=128)
    g.add_argument("--mixed-concurrency", type=int, default=32)
    g.add_argument("--mixed-prompt-lens", default="128-2048", help="uniform range LO-HI")
    g.add_argument("--mixed-output-lens", default="16-256", help="uniform range LO-HI")
    g.add_argument("--mixed-prefill-batch", type=int, default=4, help="most new requests per prefill call")
    g.add_argument("--mixed-requeue", type=float, default=0.1,
                   help="mixed_requeue: the chance per decode call that a live request is removed unfinished and "
                        "queued again at a random place (prefilled again from its prompt and output so far)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default with record, latency or the create_engine traces: "
                         "benchmarks/results/<date>_<bench|latency|harness>_<device>_tp<N>.json)")

