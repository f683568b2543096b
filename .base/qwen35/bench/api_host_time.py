"""Host time per create_engine decode call (issue #29 item 2), on any machine: what LogitsEngine.decode, the runner
and the decode graphs' row copy cost the host, the forward left out.

    python -m qwen35.bench.api_host_time [--batch-sizes 1,8,32,64] [--context 1024] [--calls 300] [--reps 3]

A tiny dense LLaMA-like (dummy weights, torch kernels, fp32, on the CPU) whose decode graphs are stand-ins that
replay nothing (NoForwardGraphs: DecodeGraphs' row copy, padding and size choice run, the decoder does not), so a
call is the host path a GPU call takes (api -> StepPlan -> runner checks -> rows copy -> replay -> LM head) with
the LM head over a 64-wide hidden state and a 1024-token vocabulary as its only arithmetic. Per batch size:
`batch` requests prefilled to --context tokens, then `calls` decode calls over all of them, each fed the argmax of the
previous call's logits (as the harness's decode mode does); the best of --reps runs, in microseconds per call.
"""
from __future__ import annotations

import argparse
import time

import torch

from qwen35.api import create_engine
from qwen35.bench.args import ints
from qwen35.cuda_graphs import DecodeGraphs, capture_sizes

TINY_LLAMA = dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  max_position_embeddings=4096, rope_theta=1e4)


class _NoReplay:
    def replay(self) -> None:
        pass


class NoForwardGraphs(DecodeGraphs):
    """DecodeGraphs whose graphs replay nothing (their outputs stay zero): the host's side of a graph call."""

    def __init__(self, runner):  # DecodeGraphs' fields, without CUDA
        self.runner, self.tails, self.size = runner, {}, 0
        self.rows = self._padded_rows()
        hidden = runner.config.hidden_size
        self.graphs = {b: (_NoReplay(), torch.zeros(b, hidden, dtype=runner.dtype))
                       for b in capture_sizes(runner.max_num_seqs)}
        self._size_for = [min(s for s in self.graphs if s >= n) for n in range(max(self.graphs) + 1)]


def decode_call_us(batch: int, context: int, calls: int, reps: int) -> float:
    eng = create_engine(TINY_LLAMA, None, device="cpu", load_format="dummy", kernels="torch", dtype="float32",
                        max_num_seqs=batch, max_model_len=context + calls * reps + 1, block_size=16)
    eng.runner.graphs = NoForwardGraphs(eng.runner)
    ids = list(range(batch))
    gen = torch.Generator().manual_seed(batch)
    tokens = eng.prefill(ids, [torch.randint(0, 1000, (context,), generator=gen) for _ in ids]).argmax(-1)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            tokens = eng.decode(ids, tokens).argmax(-1)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e6 * best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024, help="tokens per request before the decode calls")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for b in ints(args.batch_sizes):
        us = decode_call_us(b, args.context, args.calls, args.reps)
        print(f"batch {b:3d}: {us:7.1f} us per decode call (host)", flush=True)


if __name__ == "__main__":
    main()
