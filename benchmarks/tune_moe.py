"""Tune the fused MoE expert kernels' tiles on this GPU and write them to layers/moe_configs.json.

    python -m benchmarks.tune_moe [--tp 1 2 4 8] [--batches 1 2 ... 8192] [--quick]

For each tensor-parallel degree (the per-rank expert count and shared-expert width of Qwen3.5-35B-A3B at that
degree) and each token-count bucket (powers of two, or decode graph sizes between them: layers/moe/tiles.py takes
the smallest tuned bucket >= T),
routing of random inputs is laid out once per BLOCK_M candidate, then the gate_up and down kernels are timed
separately over their tile candidates; the entry kept is the BLOCK_M whose best gate_up + best down is fastest.
Decode buckets (T <= moe.DECODE_MAX_T) also get the one-kernel down+combine's tile, or null where down + combine in
two kernels (with the chosen down tile) is faster, and the GEMV path's gate_up tile, or null where route + align +
gate_up and the down step chosen above beat its gate_up + down_combine (where it wins, the bucket keeps the
down_combine tile: the GEMV path always ends in it), and the scan path's tiles (layers/moe/scan.py: route +
gate_up_scan, then down_combine or down_scan + combine), or null: the fastest of the three decides moe_fast's path
for the bucket. Decode buckets are
timed from a CUDA graph, as decode steps run (eager timing of a few-us kernel mostly measures the host's launch),
with L2 emptied of the call's data before each call (cold_graph_ms): a decode step streams ~6 GB, so its MoE weights
come from HBM, while a call timed over and over finds most of its 37 MB (one token's experts) still in L2 and
rewards tiles that do not stream well. A decode bucket whose entry the sweep changed is then confirmed: the old and
the new entry timed alternately over the whole decode path, the new one kept only where it is faster beyond chance
(confirm, holds).
`--merge A.json B.json` writes --out's table with what each of A, B changed (one TP each, tuned side by side on
separate GPUs: gpu_session.sh's tune stage). `--gemv-only` re-tunes just the GEMV path's two tiles (gate_up_gemv, down_combine) of the buckets that take it. The
file keeps other GPUs' tables and other shapes' entries; this GPU's entries for the swept shapes are replaced. Triton caches compiled kernels, so a second run is mostly timing (a full
sweep takes minutes).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.bench_moe import Layer, model_config
from layers import moe
from qwen35.bench.step_timing import graph_ms

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
PERSISTENT_CANDIDATE_MAX_T = 8  # the persistent gate_up is a GEMV-path candidate up to this T
SCAN_CANDIDATE_MIN_T = 4        # the scan path is a candidate from this T (below, a token's experts barely overlap)


def block_m_candidates(T: int) -> list[int]:
    if T <= 64:
        return [16]
    if T <= 512:
        return [16, 32]
    return [32, 64] if T <= 2048 else [64, 128]


def tile_candidates(T: int, quick: bool) -> list[dict]:
    if T <= 128:  # few rows per expert: memory-bound, the N tile sets how many programs stream weights (32 and
        # 128 first, so that --quick tries both: the full grid at the TP=4 rank shape took 128 for the down step at
        # every bucket of 4-64 tokens and 32 for gate_up at 32-64, 2026-11-28)
        grid = dict(BLOCK_N=[32, 128, 64, 16], BLOCK_K=[64, 128, 256], num_warps=[4], num_stages=[3, 4, 5])
    elif T < 1024:
        grid = dict(BLOCK_N=[64, 128], BLOCK_K=[64, 128], num_warps=[4, 8], num_stages=[3, 4])
    else:  # prefill chunks: compute-bound; wide N tiles and a short K step suit the down GEMM's K = 512
        grid = dict(BLOCK_N=[128, 64, 256], BLOCK_K=[64, 32, 128], num_warps=[8, 4], num_stages=[3, 4, 2])
    return expand(grid, quick)


def gemv_candidates(op: str, quick: bool) -> list[dict]:
    """down_combine: output columns per (token, tile) program and I step of its [k + 1 slots, BLOCK_N, BLOCK_K]
    tile; gate_up_gemv: act columns per (token, tile) program and H step of its [k slots, BLOCK_N, BLOCK_K] tiles
    (narrow: T * max(I, I_s) / BLOCK_N programs stream the weights; down_combine's BLOCK_K 512 takes whole rows of
    the I = 512 experts at once). The default first (--quick keeps two)."""
    if op == "gate_up_gemv":  # (sum_last: summed along K after the loop, layers/moe/gemv.py; the full grids at
        # TP=8 and TP=2 took 2 warps and 1-4 columns at 4-16 tokens, 2026-11-30, so --quick tries them)
        grid = dict(BLOCK_N=[4, 2, 8, 1, 16], BLOCK_K=[128, 64, 256], num_warps=[4, 2, 8, 1], num_stages=[4, 3],
                    sum_last=[False, True])
    else:
        grid = dict(BLOCK_N=[8, 4, 16, 2], BLOCK_K=[64, 512, 128, 32], num_warps=[4, 8], num_stages=[4, 3])
    return expand(grid, quick)


def persistent_candidates(quick: bool) -> list[dict]:
    """The persistent gate_up (layers/moe/gemv.py): programs per SM, act columns per item (None: as many whole
    gate|up rows as PERSISTENT_TILE holds), items in flight per program. The measured best first (1x H200)."""
    grid = dict(per_sm=[4, 8, 2], BLOCK_N=[2, 1, None], num_stages=[1, 2])
    return [dict(tile, persistent=True) for tile in expand(grid, quick)]


def expand(grid: dict, quick: bool) -> list[dict]:
    """Every combination of the grid's values (--quick: of each key's first two)."""
    if quick:
        grid = {k: v[:2] for k, v in grid.items()}
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def time_ms(fn, graph: bool = False) -> float:
    """ms per call (from a CUDA graph with L2 cold if graph), inf when the tile does not fit (shared memory,
    registers) or fails to compile: the eager call first compiles, so a failing tile never reaches a capture."""
    try:
        fn()
    except Exception as e:  # triton.runtime.errors.OutOfResources and compile errors of oversized tiles
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        return float("inf")
    if graph:
        return cold_graph_ms(fn)
    return triton.testing.do_bench(fn, warmup=3, rep=10)


_FLUSH: list[torch.Tensor] = []


def _flush_l2() -> None:
    """Read 128 MB (more than twice any L2 of ours) so that the next call finds none of its data in L2; a read, not
    a write, so that L2 holds no dirty lines to write back during that call, as after a decode step's weight reads."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(64 << 20, dtype=torch.bfloat16, device="cuda"))
    _FLUSH[0].sum(dtype=torch.float32)


def cold_graph_ms(fn, calls: int = 20) -> float:
    """ms per call of fn with L2 cold: one CUDA graph of `calls` x (L2 flush, fn) against one of the flushes alone;
    the difference per call."""
    def both():
        _flush_l2()
        fn()
    flushed = graph_ms(lambda: [both() for _ in range(calls)], replays=3)
    return max(0.0, flushed - graph_ms(lambda: [_flush_l2() for _ in range(calls)], replays=3)) / calls


def best_tile(fn, T: int, quick: bool, candidates: list[dict] | None = None) -> tuple[float, dict]:
    graph = T <= moe.DECODE_MAX_T
    return min(((time_ms(lambda: fn(tile), graph), tile) for tile in candidates or tile_candidates(T, quick)),
               key=lambda r: r[0])


def tune_bucket(layer: Layer, T: int, quick: bool, gen: torch.Generator) -> dict:
    x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = F.linear(x, layer.router)
    ids, weights, gate = moe.route_fast(logits, layer.top_k)
    w, num_local = layer.w, layer.w.gate_up.shape[0]
    best = None
    for block_m in block_m_candidates(T):
        lay = moe.align_fast(ids, w.start, num_local, block_m)
        t_up, up = best_tile(lambda tile: moe.gate_up_fast(x, w, lay, tile), T, quick)
        act = moe.gate_up_fast(x, w, lay, up)
        t_down, down = best_tile(lambda tile: moe.down_fast(act, w, lay, weights, gate, tile), T, quick)
        if best is None or t_up + t_down < best[0]:
            best = (t_up + t_down, {"BLOCK_M": block_m, "gate_up": up, "down": down}, lay, act)
        print(f"  T={T:<5} BLOCK_M={block_m:<3} gate_up {t_up * 1e3:8.1f} us {up}  down {t_down * 1e3:8.1f} us {down}",
              flush=True)
    _, entry, lay, act = best
    if T <= moe.DECODE_MAX_T:
        t_dc, dc = best_tile(lambda tile: moe.down_combine_fast(act, w, lay.inverse, ids, weights, gate, tile), T,
                             quick, gemv_candidates("down_combine", quick))
        t_split = time_ms(lambda: moe.combine_fast(moe.down_fast(act, w, lay, weights, gate, entry["down"]), lay.inverse, T),
                          graph=True)
        entry["down_combine"] = dc if t_dc < t_split else None  # None: down and combine stay two kernels
        print(f"  T={T:<5} down_combine {t_dc * 1e3:8.1f} us {dc} vs down + combine {t_split * 1e3:8.1f} us",
              flush=True)
        tune_gemv(layer, x, logits, entry, min(t_dc, t_split), dc, quick)
    return entry


def tune_gemv(layer: Layer, x: torch.Tensor, logits: torch.Tensor, entry: dict, t_down: float, dc: dict,
              quick: bool) -> None:
    """The bucket's decode path, the fastest of three (the router GEMM, common to all, left out):
    - the sorted layout's: route + align + gate_up + the down step chosen above (t_down ms);
    - the GEMV path: gate_up_gemv (routing inside) at its best tile + down_combine (tile dc): entry["gemv"];
    - the scan path (T >= SCAN_CANDIDATE_MIN_T): route + gate_up_scan at its best tile, then down_combine (tile dc)
      or down_scan at its best tile + combine: entry["scan"] = {"gate_up": tile, "down": tile or None}.
    The GEMV path and the scan path with down_combine keep entry["down_combine"] = dc."""
    T, k, w = x.shape[0], layer.top_k, layer.w
    num_local = w.gate_up.shape[0]
    t_layout = t_down + time_ms(lambda: moe.gate_up_fast(
        x, w, moe.align_fast(moe.route_fast(logits, k)[0], w.start, num_local, entry["BLOCK_M"]), entry["gate_up"]),
        graph=True)
    t_up, gemv, g = best_gate_up_gemv(layer, x, logits, quick)
    t_gemv = t_up + time_ms(lambda: moe.down_combine_fast(g.act, w, g.inverse, g.ids, g.weights, g.shared_gate, dc),
                            graph=True)
    t_scan, scan = tune_scan(layer, x, logits, dc, quick) if T >= SCAN_CANDIDATE_MIN_T else (float("inf"), None)
    best = min(t_layout, t_gemv, t_scan)
    entry["gemv"] = gemv if best == t_gemv else None
    entry["scan"] = scan if best == t_scan and best < min(t_layout, t_gemv) else None
    if entry["gemv"] is not None or (entry["scan"] is not None and entry["scan"]["down"] is None):
        entry["down_combine"] = dc  # these paths end in down_combine
    print(f"  T={T:<5} gemv {t_gemv * 1e3:8.1f} us {gemv} (gate_up {t_up * 1e3:.1f}) | scan {t_scan * 1e3:8.1f} us "
          f"{scan} | route + align + gate_up + down {t_layout * 1e3:8.1f} us", flush=True)


def tune_scan(layer: Layer, x: torch.Tensor, logits: torch.Tensor, dc: dict, quick: bool) -> tuple[float, dict]:
    """(ms, entry) of the scan path after the router GEMM: route_fast + gate_up_scan at its best tile, then the
    better of down_combine (tile dc) and down_scan at its best tile + combine."""
    k, w = layer.top_k, layer.w
    T = x.shape[0]
    ids, weights, gate = moe.route_fast(logits, k)
    t_up, up = best_tile(lambda tile: moe.gate_up_scan_fast(x, ids, weights, gate, w, tile), T, quick,
                         scan_candidates("gate_up", quick))
    t_route = time_ms(lambda: moe.route_fast(logits, k), graph=True)
    g = moe.gate_up_scan_fast(x, ids, weights, gate, w, up)
    t_dc = time_ms(lambda: moe.down_combine_fast(g.act, w, g.inverse, ids, weights, gate, dc), graph=True)
    t_down, down = best_tile(
        lambda tile: moe.combine_fast(moe.down_scan_fast(g.act, w, g.inverse, ids, weights, gate, tile), g.inverse, T),
        T, quick, scan_candidates("down", quick))
    print(f"  T={T:<5} scan: route {t_route * 1e3:.1f} gate_up {t_up * 1e3:.1f} us {up}; down_combine "
          f"{t_dc * 1e3:.1f} | down_scan + combine {t_down * 1e3:.1f} us {down}", flush=True)
    return t_route + t_up + min(t_dc, t_down), {"gate_up": up, "down": down if t_down < t_dc else None}


def scan_candidates(op: str, quick: bool) -> list[dict]:
    """gate_up_scan / down_scan tiles (layers/moe/scan.py): a [16, BLOCK_K] x [BLOCK_K, BLOCK_N] tl.dot a step,
    a program per (expert, N tile). The default first (--quick keeps two of each)."""
    if op == "gate_up":
        grid = dict(BLOCK_M=[16], BLOCK_N=[32, 16, 64], BLOCK_K=[128, 64, 256], num_warps=[4, 8],
                    num_stages=[3, 4])
    else:
        grid = dict(BLOCK_M=[16], BLOCK_N=[64, 128, 256, 32], BLOCK_K=[128, 64], num_warps=[4, 8],
                    num_stages=[3, 2])
    return expand(grid, quick)


def best_gate_up_gemv(layer: Layer, x: torch.Tensor, logits: torch.Tensor, quick: bool):
    """(ms, tile, outputs) of the GEMV path's gate_up at its best tile: the outputs are what down_combine reads."""
    k, w = layer.top_k, layer.w
    # the persistent kernel (layers/moe/gemv.py) competes at small T
    persistent = persistent_candidates(quick) if x.shape[0] <= PERSISTENT_CANDIDATE_MAX_T else []
    t, tile = best_tile(lambda cand: moe.gate_up_gemv_fast(x, logits, k, w, cand), x.shape[0], quick,
                        persistent + gemv_candidates("gate_up_gemv", quick))
    return t, tile, moe.gate_up_gemv_fast(x, logits, k, w, tile)


def retune_gemv(layer: Layer, T: int, entry: dict, quick: bool, gen: torch.Generator) -> None:
    """The GEMV path's gate_up_gemv and down_combine tiles of a bucket that takes it, the rest of its entry kept."""
    x = torch.randn(T, layer.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = F.linear(x, layer.router)
    k, w = layer.top_k, layer.w
    was = (time_ms(lambda: moe.gate_up_gemv_fast(x, logits, k, w, entry["gemv"]), graph=True), entry["gemv"])
    t_up, gemv, g = best_gate_up_gemv(layer, x, logits, quick)
    down = lambda tile: moe.down_combine_fast(g.act, w, g.inverse, g.ids, g.weights, g.shared_gate, tile)  # noqa
    was_dc = (time_ms(lambda: down(entry["down_combine"]), graph=True), entry["down_combine"])
    t_dc, dc = best_tile(down, T, quick, gemv_candidates("down_combine", quick))
    entry["gemv"], entry["down_combine"] = faster((t_up, gemv), was)[1], faster((t_dc, dc), was_dc)[1]
    print(f"  T={T:<5} gate_up_gemv {t_up * 1e3:6.1f} us {gemv} (was {was[0] * 1e3:.1f} us {was[1]})  "
          f"down_combine {t_dc * 1e3:6.1f} us {dc} (was {was_dc[0] * 1e3:.1f} us {was_dc[1]})", flush=True)


CONFIRM_ROUNDS = 7  # confirm: old and new timed alternately this many times on each of CONFIRM_INPUTS inputs
CONFIRM_INPUTS = 2
CONFIRM_Z = 2.33    # one-sided Mann-Whitney at p ~ 0.01


def confirm(layer: Layer, T: int, old: dict, new: dict, gen: torch.Generator) -> dict:
    """old or new, the entry of a decode bucket the sweep changed, by timing the whole decode path (router GEMM
    included, L2 cold) with each, alternately, on fresh inputs: new only where it `holds`. A sweep keeps the least
    of ~200 noisy timings, so its winner is often lucky: TP=8's full grid of 2026-11-30 had buckets 1 and 2 faster by
    1-2 us in the sweep and within the noise or slower (+2.3%) in this comparison."""
    hidden, inter, shared = layer.hidden, layer.w.down.shape[2], layer.w.shared_down.shape[1]
    cfgs = {name: moe.entry_config(T, entry, hidden, inter, shared) for name, entry in (("old", old), ("new", new))}
    times = {"old": [], "new": []}
    for _ in range(CONFIRM_INPUTS):
        x = torch.randn(T, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        for r in range(CONFIRM_ROUNDS):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                times[name].append(time_ms(lambda: moe.decode_path(x, layer.router, layer.top_k, layer.w,
                                                                   cfg=cfgs[name]), graph=True))
    keep = holds(times["new"], times["old"])
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"  T={T:<5} confirm: old {med['old']:.2f} us, new {med['new']:.2f} us (medians of {len(times['old'])}): "
          f"{'new' if keep else 'old'} kept", flush=True)
    return new if keep else old


def holds(new: list[float], old: list[float], z: float = CONFIRM_Z) -> bool:
    """Whether the times `new` are smaller than `old` beyond chance: a one-sided Mann-Whitney U test (normal
    approximation, ties counted half) at z."""
    u = sum((a < b) + 0.5 * (a == b) for a in new for b in old)
    n, m = len(new), len(old)
    return (u - n * m / 2) / (n * m * (n + m + 1) / 12) ** 0.5 > z


def faster(new: tuple[float, dict], old: tuple[float, dict]) -> tuple[float, dict]:
    """(time, tile) of the grid's best or of the tile a re-tune started from, whichever was faster: a tile the grid
    lacks (--quick's) stays where it is faster (ties keep the old one)."""
    return new if new[0] < old[0] else old


def merge_tables(base: dict, tuned: list[dict]) -> dict:
    """base with every (GPU, shape, bucket) entry that one of the tuned tables changed: runs of one TP each, on
    separate GPUs, each starting from a copy of base (gpu_session.sh's tune stage); a later table wins a conflict."""
    out = json.loads(json.dumps(base))
    for table in tuned:
        for device, shapes in table.items():
            for key, buckets in shapes.items():
                for bucket, entry in buckets.items():
                    if base.get(device, {}).get(key, {}).get(bucket) != entry:
                        out.setdefault(device, {}).setdefault(key, {})[bucket] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                    help="token counts: powers of two, or decode graph sizes between them (layers/moe/tiles.py)")
    ap.add_argument("--quick", action="store_true", help="a smaller tile grid")
    ap.add_argument("--out", default=moe.CONFIG_FILE)
    ap.add_argument("--gemv-only", action="store_true",
                    help="re-tune only the GEMV path's gate_up_gemv and down_combine tiles of the buckets that take it")
    ap.add_argument("--merge", nargs="+", metavar="TUNED",
                    help="tune nothing: write to --out its table with what each TUNED table changed (merge_tables)")
    args = ap.parse_args()
    if args.merge:
        with open(args.out) as f:
            base = json.load(f)
        tuned = []
        for path in args.merge:
            with open(path) as f:
                tuned.append(json.load(f))
        with open(args.out, "w") as f:
            json.dump(merge_tables(base, tuned), f, indent=1, sort_keys=True)
        print(f"merged {len(tuned)} tables into {args.out}")
        return
    cfg = model_config()
    device = torch.cuda.get_device_name()
    table = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            table = json.load(f)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tp in args.tp:
        layer = Layer(cfg, tp)
        key = moe.config_key(layer.w.gate_up.shape[0], cfg.hidden_size, layer.w.down.shape[2])
        print(f"{device} TP={tp}: {key}, shared intermediate {layer.w.shared_down.shape[1]}", flush=True)
        entries = table.setdefault(device, {}).setdefault(key, {})
        for T in args.batches:
            before = copy.deepcopy(entries.get(str(T)))  # (retune_gemv changes the entry in place)
            if not args.gemv_only:
                entries[str(T)] = tune_bucket(layer, T, args.quick, gen)
            elif (entries.get(str(T)) or {}).get("gemv"):
                retune_gemv(layer, T, entries[str(T)], args.quick, gen)
            if before is not None and entries.get(str(T)) != before and T <= moe.DECODE_MAX_T:
                entries[str(T)] = confirm(layer, T, before, entries[str(T)], gen)
            with open(args.out, "w") as f:  # after each bucket, so an interrupted sweep keeps what it found
                json.dump(table, f, indent=1, sort_keys=True)
        del layer
        torch.cuda.empty_cache()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
