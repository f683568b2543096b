"""Where a decode step's GPU time goes, per layer kind, at any TP: torch.profiler over the full-size dummy model.

    torchrun --nproc-per-node N -m benchmarks.profile_step [--decode-batch 1,8] [--ctx 1024] [--json FILE]
    python -m benchmarks.profile_step ...                      (TP=1)

Every rank builds the runner (dummy weights, CUDA graphs as served) and runs the same steps; every rank profiles (the
same overhead everywhere, so no rank is made the straggler), rank 0 reports. Per batch size:

1. One eager step with a profiler range around every decoder layer gives each kernel its place: (layer, kind) or a
   model-level part (embedding, final norm, LM head).
2. Graph replays of the same step (as served) give the kernels' times; they are matched to the eager kernels by
   name in order (difflib), so each replayed kernel inherits its place.
3. Reported per layer kind (deltanet / attention): each kernel of a layer in order with its mean time and the mean
   gap before it (the time since the previous kernel ended: launch latency, ramp, waiting), the layer's total, and
   the cross-GPU kernels (all-reduce, all-gather) apart; then the parts outside the layers and the step's span.

A kernel that waits for its peers (the all-reduces, the pulls) counts that wait as its own time. The profiled steps
start apart (a host barrier between them), so the first cross-GPU kernel of a step (the embedding's all-reduce)
absorbs the ranks' launch skew, which back-to-back steps do not have: the layers' table is the figure to read.
At TP > 1 every rank's replayed kernels are gathered to rank 0, which adds per kernel of a layer: its time on each
rank and how far apart the ranks start and end it (max - min over ranks of the profiler's timestamps, which share
the host's clock; the ranks replay the same graph, so kernel i of a step is the same kernel on every rank). A kernel
that waits for a peer starts apart and ends together: the early rank's extra time is the wait.
--prefill also prints the top kernels of one prefill.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import statistics
import sys
import tempfile
import zlib
from collections import defaultdict

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile, record_function

from dist import parallel
from qwen35.config import LINEAR_ATTENTION, ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from qwen35.synth import preset_text
from scheduler.plan import StepPlan

COMM_MARKERS = ("all_reduce", "one_shot", "two_shot", "all_gather", "nccl", "boundary")


def is_comm(name: str) -> bool:
    return any(m in name.lower() for m in COMM_MARKERS)


def short(name: str) -> str:
    """A kernel's name without template arguments and launch decorations (readable in a table)."""
    return name.split("(")[0].split("<")[0].replace("void ", "")[:60]


# ---------------------------------------------------------------------------------------------- trace reading
def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def kernels_of(events: list[dict]) -> list[dict]:
    """Kernel events in start order (memcpy / memset are not kernels)."""
    ks = [e for e in events if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda e: float(e["ts"]))


def label_eager(events: list[dict]) -> list[tuple[str, str]]:
    """(name, place) of each kernel of an eager step: place = the innermost profiler range ("L<i>:<kind>" or a
    model part) around the host call that launched it (matched by the CUPTI correlation id)."""
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e and "correlation" in e["args"]:
            launches[e["args"]["correlation"]] = float(e["ts"])
    ranges = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"].startswith(("L", "model:"))),
                    key=lambda r: r[0])
    out = []
    for k in kernels_of(events):
        ts = launches.get(k.get("args", {}).get("correlation"))
        place = "other"
        if ts is not None:
            inner = [r for r in ranges if r[0] <= ts <= r[1]]
            if inner:
                place = min(inner, key=lambda r: r[1] - r[0])[2]
        out.append((k["name"], place))
    return out


def split_at_markers(kernels: list[dict], marker: str = "_step_marker") -> list[list[dict]]:
    """The kernels after each marker kernel, up to the next (the marker itself left out)."""
    groups = []
    for k in kernels:
        if marker in k["name"]:
            groups.append([])
        elif groups:
            groups[-1].append(k)
    return groups


def place_graph_kernels(step: list[dict], eager: list[tuple[str, str]]) -> list[tuple[str, str, float, float]]:
    """(name, place, duration us, gap before it us) of each kernel of one replayed step, the places taken from the
    eager step's kernels matched by name in order."""
    names = [k["name"] for k in step]
    places = ["other"] * len(step)
    sm = difflib.SequenceMatcher(a=[n for n, _ in eager], b=names, autojunk=False)
    for block in sm.get_matching_blocks():
        for i in range(block.size):
            places[block.b + i] = eager[block.a + i][1]
    out, prev_end = [], None
    for k, place in zip(step, places):
        ts, dur = float(k["ts"]), float(k["dur"])
        out.append((k["name"], place, dur, 0.0 if prev_end is None else max(0.0, ts - prev_end)))
        prev_end = ts + dur
    return out


# ---------------------------------------------------------------------------------------------- summary
def summarize(steps: list[list[tuple[str, str, float, float]]], kinds: dict[int, str]) -> dict:
    """Per layer kind: the kernel sequence of a layer (mean time and gap per position over layers and steps), and
    the parts outside the layers; per step: span, busy, kernels."""
    per_kind: dict[str, list[list[tuple[str, float, float]]]] = defaultdict(list)  # kind -> layers -> kernels
    outside: dict[str, list[float]] = defaultdict(list)
    spans, busy, counts = [], [], []
    for step in steps:
        layers: dict[int, list[tuple[str, float, float]]] = defaultdict(list)
        t = 0.0
        for name, place, dur, gap in step:
            t += dur + gap
            if place.startswith("L") and ":" in place:
                layers[int(place[1:].split(":")[0])].append((name, dur, gap))
            else:
                outside[f"{place} {short(name)}"].append(dur + gap)
        for i, ks in layers.items():
            per_kind[kinds[i]].append(ks)
        spans.append(t)
        busy.append(sum(d for _, _, d, _ in step))
        counts.append(len(step))
    result = {"step_span_us": statistics.median(spans), "kernels_busy_us": statistics.median(busy),
              "kernels_per_step": int(statistics.median(counts)), "kinds": {}, "outside": {}}
    nsteps = len(steps)
    for kind, layers in per_kind.items():
        shape = max(set(tuple(short(n) for n, _, _ in ks) for ks in layers),
                    key=lambda s: sum(1 for ks in layers if tuple(short(n) for n, _, _ in ks) == s))
        same = [ks for ks in layers if tuple(short(n) for n, _, _ in ks) == shape]
        rows = []
        for j, name in enumerate(shape):
            rows.append({"kernel": name, "us": statistics.mean(ks[j][1] for ks in same),
                         "gap_us": statistics.mean(ks[j][2] for ks in same), "comm": is_comm(name)})
        result["kinds"][kind] = {
            "layers_per_step": len(layers) // max(1, nsteps), "kernels_per_layer": len(shape),
            "layers_with_other_kernels": len(layers) - len(same), "kernels": rows,
            "layer_us": sum(r["us"] + r["gap_us"] for r in rows),
            "comm_us": sum(r["us"] for r in rows if r["comm"]),
            "gaps_us": sum(r["gap_us"] for r in rows)}
    result["outside"] = {k: sum(v) / nsteps for k, v in sorted(outside.items(), key=lambda kv: -sum(kv[1]))}
    return result


def cross_rank(steps: list[list[dict]], placed: list[list[tuple[str, str, float, float]]],
               kinds: dict[int, str], device: str = "cuda") -> dict | None:
    """Per layer kind, per kernel position (as summarize's shape): the mean time on each rank and the mean spread
    of the ranks' starts and ends (us). steps: this rank's replayed steps' kernel events; placed: rank 0's placed
    kernels of the same steps. Each step is compared over the kernels every rank ran (after the LM head rank 0
    alone concatenates the gathered logits); None where those differ in name (then there is no alignment)."""
    if parallel.tp_size() == 1:
        return None
    counts = torch.tensor([len(s) for s in steps], dtype=torch.int64, device=device)
    common = parallel.all_gather(counts).min(0).values.tolist()  # per step: the kernels every rank ran
    kept = [s[:n] for s, n in zip(steps, common)]
    names = torch.tensor([zlib.crc32(short(k["name"]).encode()) for s in kept for k in s], dtype=torch.int64,
                         device=device)
    names_all = parallel.all_gather(names)
    if not bool((names_all == names_all[0]).all()):
        return None
    flat = torch.tensor([[float(k["ts"]), float(k["dur"])] for s in kept for k in s], dtype=torch.float64,
                        device=device)
    every = parallel.all_gather(flat).cpu()  # [tp, kernels, 2]
    if not parallel.is_driver():
        return None
    start, end = every[..., 0], every[..., 0] + every[..., 1]
    rows: dict[tuple[str, int, str], list[tuple[list[float], float, float]]] = defaultdict(list)
    i = 0
    for step, n in zip(placed, common):
        seen: dict[int, int] = defaultdict(int)
        for name, place, _, _ in step[:n]:
            if place.startswith("L") and ":" in place:
                layer = int(place[1:].split(":")[0])
                rows[(kinds[layer], seen[layer], short(name))].append(
                    (every[:, i, 1].tolist(), float(start[:, i].max() - start[:, i].min()),
                     float(end[:, i].max() - end[:, i].min())))
                seen[layer] += 1
            i += 1
    out: dict[str, list[dict]] = defaultdict(list)
    for (kind, j, name), v in sorted(rows.items(), key=lambda kv: kv[0][:2]):
        if len(v) < len(placed):  # (a kernel of a few layers only: summarize's shape leaves them out too)
            continue
        out[kind].append({"kernel": name, "us_by_rank": [statistics.mean(d[r] for d, _, _ in v)
                                                         for r in range(len(v[0][0]))],
                          "start_spread_us": statistics.mean(s for _, s, _ in v),
                          "end_spread_us": statistics.mean(e for _, _, e in v)})
    return dict(out)


def print_cross_rank(x: dict) -> None:
    print("--- across ranks (us: time on each rank; spread of the ranks' starts / ends)")
    for kind, rows in x.items():
        print(f"  {kind}")
        for r in rows:
            print(f"    {' / '.join(f'{u:5.1f}' for u in r['us_by_rank'])}   start {r['start_spread_us']:5.1f}  "
                  f"end {r['end_spread_us']:5.1f}  {r['kernel']}")


def print_summary(batch: int, s: dict) -> None:
    print(f"\n=== decode batch {batch}: step span {s['step_span_us'] / 1e3:.3f} ms, kernels busy "
          f"{s['kernels_busy_us'] / 1e3:.3f} ms, {s['kernels_per_step']} kernels")
    for kind, k in s["kinds"].items():
        print(f"--- {kind}: {k['layers_per_step']} layers x {k['layer_us']:.1f} us = "
              f"{k['layers_per_step'] * k['layer_us'] / 1e3:.3f} ms; {k['kernels_per_layer']} kernels per layer, "
              f"cross-GPU {k['comm_us']:.1f} us, gaps {k['gaps_us']:.1f} us"
              + (f" ({k['layers_with_other_kernels']} layers differ)" if k["layers_with_other_kernels"] else ""))
        for r in k["kernels"]:
            print(f"    {r['gap_us']:6.1f} gap {r['us']:7.1f} us  {'*' if r['comm'] else ' '} {r['kernel']}")
    print("--- outside the layers (us per step, kernel + gap before it)")
    for name, us in list(s["outside"].items())[:12]:
        print(f"    {us:8.1f}  {name}")


# ---------------------------------------------------------------------------------------------- the runs
def layer_ranges(model) -> list:
    """Profiler ranges around every decoder layer ("L<i>:<kind>") and the model's parts; returns the hooks."""
    hooks = []

    def wrap(module, name):
        state = {}

        def pre(_m, _a):
            state["rf"] = record_function(name)
            state["rf"].__enter__()

        def post(_m, _a, _o):
            state.pop("rf").__exit__(None, None, None)

        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))

    for i, layer in enumerate(model.layers):
        wrap(layer, f"L{i}:{'deltanet' if layer.is_linear else 'attention'}")
    wrap(model.embed_tokens, "model:embedding")
    wrap(model.norm, "model:final_norm")
    wrap(model.lm_head, "model:lm_head")
    return hooks


def decode_plan(runner, batch: int, ctx: int) -> StepPlan:
    nblk = -(-ctx // runner.block_size)
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, runner.config.vocab_size - 300, (batch, 1), generator=gen).tolist()
    return StepPlan(state_slots=list(range(batch)), token_ids=tokens, start_pos=[ctx - 1] * batch,
                    block_tables=[list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)],
                    want_logits=[True] * batch)


def profile_decode(runner, batch: int, ctx: int, replays: int) -> dict:
    plan = decode_plan(runner, batch, ctx)
    for _ in range(3):
        runner.execute(plan)  # warm-up (tables set, graph picked, compiles)
    torch.cuda.synchronize()
    parallel.barrier()
    hooks = layer_ranges(runner.model)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.execute(plan, eager=True)
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    eager = label_eager(trace_events(prof))
    parallel.barrier()
    mark = torch.zeros(1, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            _step_marker[(1,)](mark)  # (where a step starts: idle gaps can fall inside a TP step too)
            runner.execute(plan)
            torch.cuda.synchronize()
            parallel.barrier()  # steps apart: only the gaps inside a step are counted
    steps = split_at_markers(kernels_of(trace_events(prof)))[-replays:]
    placed = [place_graph_kernels(s, eager) for s in steps]
    kinds = {i: ("deltanet" if t == LINEAR_ATTENTION else "attention") for i, t in enumerate(runner.config.layer_types)}
    out = summarize(placed, kinds)
    out.update(batch=batch, ctx=ctx, graph=runner.graphs is not None)
    ranks = cross_rank(steps, placed, kinds)
    if ranks is not None:
        out["across_ranks"] = ranks
    return out


def top_prefill(runner, seqs: int, length: int, n: int = 15) -> None:
    nblk = -(-length // runner.block_size)
    ids = torch.randint(0, 248000, (seqs, length)).tolist()
    plan = StepPlan(list(range(seqs)), ids, [0] * seqs, [list(range(i * nblk, (i + 1) * nblk)) for i in range(seqs)],
                    [True] * seqs)
    runner.execute(plan)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.execute(plan)
        torch.cuda.synchronize()
    if parallel.is_driver():
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        print(f"--- prefill {seqs} x {length}: {sum(e.self_device_time_total for e in events) / 1e3:.2f} ms of kernels")
        for e in events[:n]:
            print(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x  {short(e.key)}")


@triton.jit
def _step_marker(x):
    tl.store(x, tl.load(x) + 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="a synthetic preset (full-size dummy weights)")
    ap.add_argument("--decode-batch", default="1,8")
    ap.add_argument("--ctx", type=int, default=1024, help="tokens in each sequence's context")
    ap.add_argument("--layers", type=int, default=0, help="the first N layers only (0: all)")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--prefill", default="", help="SEQSxLEN: also the top kernels of one prefill")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (every step eager)")
    ap.add_argument("--json", default=None, help="write the summaries here (rank 0)")
    args = ap.parse_args(argv)
    parallel.init_distributed("cuda")
    cfg = ModelConfig.from_dict({"text_config": preset_text(args.model, args.layers)})
    batches = [int(b) for b in args.decode_batch.split(",")]
    pre = [int(v) for v in args.prefill.split("x")] if args.prefill else []
    rows = max(batches + pre[:1])
    max_len = max([args.ctx] + pre[1:]) + 64
    runner = ModelRunner(cfg, EngineArgs(model=args.model, load_format="dummy", device="cuda",
                                         max_num_seqs=max(rows, 8), max_model_len=max_len, enforce_eager=args.eager,
                                         num_kv_blocks=rows * -(-max_len // 16) + 64))
    results = {"tp": parallel.tp_size(), "device": torch.cuda.get_device_name(), "model": args.model,
               "command": "benchmarks.profile_step " + " ".join(argv if argv is not None else sys.argv[1:]),
               "decode": []}
    if pre:
        top_prefill(runner, *pre)
    for b in batches:
        s = profile_decode(runner, b, args.ctx, args.replays)
        results["decode"].append(s)
        if parallel.is_driver():
            print_summary(b, s)
            if "across_ranks" in s:
                print_cross_rank(s["across_ranks"])
    if parallel.is_driver() and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    parallel.destroy()


if __name__ == "__main__":
    main()
