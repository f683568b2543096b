"""The MoE kernels' tiles and path choices, per bucket of T: the tuned table for this GPU model and rank shape
(layers/moe_configs.json, written by benchmarks/tune_moe.py), else the defaults below (their thresholds powers of
two)."""
from __future__ import annotations

import functools
import json
import os

import torch

from layers.backend import triton
from layers.moe.experts import ExpertWeights

CONFIG_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moe_configs.json")
DECODE_MAX_T = 64        # moe_fast: the decode kernels at or below this many tokens; above, the grouped path
DOWN_COMBINE_TILE = dict(BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=4)  # untuned default
DOWN_COMBINE_MAX_T = 8   # untuned default: down + combine in one kernel at or below (it paid at T <= 8: 6.8 against
                         # 9.0 us at T = 1, 1x H200). Above, re-reading an expert two tokens share (and the shared
                         # expert, T times) costs more than the launch it saves; how much depends on the rank's
                         # shape, so a tuned table decides per bucket (moe_config)
GEMV_TILE = dict(BLOCK_N=4, BLOCK_K=128, num_warps=4, num_stages=4)  # untuned default: 128 programs per token at
                                                                     # I = 512, so one token's experts fill the SMs
# (the H200 table holds tiles for the GEMV path's buckets at TP=1 from a sweep on 2026-11-25: gate_up_gemv 16.5 ->
# 12.1 us at T = 1 and 71.3 -> 67.0 at T = 8, down_combine 6.4 -> 5.6 and 35.9 -> 34.9, in CUDA graphs)
PERSISTENT_MAX_T = 4     # untuned default: the persistent gate_up kernel at or below (layers/moe/gemv.py), with
PERSISTENT_GEMV = dict(persistent=True, per_sm=4, BLOCK_N=2, num_stages=1)  # this tile. 1x H200, L2 cold, every
                         # rank shape (benchmarks/bench_gate_up_gemv.py, 2026-11-27): at T = 1 8.7 / 10.7 / 14.7 us at
                         # TP = 4 / 2 / 1 against the per-token kernel's 22.2 / 21.0 / 23.1 (its tuned tiles 14.7 /
                         # 15.5 / 15.7); at T = 8 and TP = 1 72.8 against 72.1 (every program routes all its tokens'
                         # items, each token reading its own copy of a shared expert)
GEMV_MAX_T = 8           # untuned default: the GEMV path at or below (a power of two, as every threshold). Above, each
                         # token streams its experts' gate_up rows itself, where the grouped kernel reads an expert
                         # once for all its tokens; a tuned table decides per bucket (moe_config)


def moe_config(T: int, num_local: int, hidden: int, inter: int, shared_inter: int, device: torch.device) -> dict:
    """Tiles for T tokens: the table's entry for the smallest tuned bucket >= T (else the largest), else
    default_config; N/K tiles capped at the (power-of-two rounded) matrix sizes so that tiny models work too
    (down_combine_fast and gate_up_gemv_fast cap their own tiles: they know their GEMVs' sizes). Tuned buckets are
    powers of two and may be any decode graph size besides (qwen35/cuda_graphs.py capture_sizes: a step pads its
    rows to the next graph size, and no bucket falls between a batch and its padding, so both get the same tiles,
    hence the same bits). Made once per T and shape: eager steps ask every layer (read only: callers copy a tile
    before changing it)."""
    return _moe_config(T, num_local, hidden, inter, shared_inter, device)


@functools.lru_cache(maxsize=None)
def _moe_config(T: int, num_local: int, hidden: int, inter: int, shared_inter: int, device: torch.device) -> dict:
    entries = tuned_entries(device, config_key(num_local, hidden, inter))
    entry = {}
    if entries:
        buckets = sorted(int(b) for b in entries)
        entry = entries[str(next((b for b in buckets if b >= T), buckets[-1]))]
    return entry_config(T, entry, hidden, inter, shared_inter)


def entry_config(T: int, entry: dict, hidden: int, inter: int, shared_inter: int) -> dict:
    """moe_config's tiles from one table entry (default_config where it lacks a key): the table's own, or an entry
    a benchmark compares against it (benchmarks/tune_moe.py's confirm)."""
    cfg = {**default_config(T), **entry}
    width = triton.next_power_of_2(max(inter, shared_inter))
    return {"BLOCK_M": cfg["BLOCK_M"],
            "gate_up": cap_tile(cfg["gate_up"], width, triton.next_power_of_2(hidden)),
            "down": cap_tile(cfg["down"], triton.next_power_of_2(hidden), width),
            "down_combine": cfg["down_combine"], "gemv": cfg["gemv"], "scan": cfg.get("scan")}


def config_for(x: torch.Tensor, w: ExpertWeights) -> dict:
    """moe_config for this call's T and this rank's expert shapes."""
    return moe_config(x.shape[0], w.gate_up.shape[0], x.shape[1], w.down.shape[2], w.shared_down.shape[1], x.device)


def default_config(T: int) -> dict:
    """Tiles when the table has no entry. Decode (few rows per expert): BLOCK_M 16, one row block per expert, so
    each weight tile is read once; narrow N tiles so that the few active experts still spread over all SMs.
    Prefill: larger tiles that reuse each weight tile over many rows. down_combine (its tile, or None: down and
    combine in two kernels), gemv (gate_up_gemv_fast's tile, or None) and scan ({"gate_up": gate_up_scan_fast's
    tile, "down": down_scan_fast's or None for down_combine}, or None) serve T <= DECODE_MAX_T only and choose its
    path (layers/moe/block.py decode_path); only a tuned table takes the scan path; tables tuned before these keys
    lack them."""
    gemv = PERSISTENT_GEMV if T <= PERSISTENT_MAX_T else GEMV_TILE
    small = {"down_combine": DOWN_COMBINE_TILE if T <= DOWN_COMBINE_MAX_T else None,
             "gemv": gemv if T <= GEMV_MAX_T else None, "scan": None}
    if T <= 128:
        return {"BLOCK_M": 16, "gate_up": dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
                "down": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4), **small}
    block_m = 32 if T <= 1024 else 64
    return {"BLOCK_M": block_m, "gate_up": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
            "down": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3), **small}


def token_buckets(max_tokens: int, w: ExpertWeights | None = None, device: torch.device | None = None) -> list[int]:
    """Every T up to max_tokens at which moe_config may change for w's rank shape: the powers of two (default_config's
    thresholds) and the tuned buckets between them (w None, a model without experts: the powers of two). A warm-up
    that meets each (and one below it) meets every tile a step can: none compiles mid-serving."""
    tuned = {} if w is None else \
        tuned_entries(device, config_key(w.gate_up.shape[0], w.gate_up.shape[2], w.down.shape[2]))
    powers = {1 << i for i in range(max_tokens.bit_length())}
    return sorted(b for b in powers | {int(b) for b in tuned} if b <= max_tokens)


def config_key(num_local: int, hidden: int, inter: int) -> str:
    return f"E{num_local}_H{hidden}_I{inter}"


def tuned_entries(device: torch.device, key: str) -> dict:
    """The tuned table's buckets for rank shape `key` on this GPU model ({} on the CPU or where none were tuned)."""
    if device.type != "cuda":
        return {}
    return _table(device.index if device.index is not None else torch.cuda.current_device()).get(key, {})


@functools.lru_cache(maxsize=None)
def _table(device_index: int) -> dict:
    """The tuned configs for this GPU model (benchmarks/tune_moe.py writes them), {} when there are none."""
    try:
        with open(CONFIG_FILE) as f:
            return json.load(f).get(torch.cuda.get_device_name(device_index), {})
    except FileNotFoundError:
        return {}


def cap_tile(tile: dict, n: int, k: int, least: int = 16) -> dict:
    """N and K tiles no larger than the (power-of-two) matrix, no smaller than tl.dot's 16 (a GEMV's: least)."""
    return dict(tile, BLOCK_N=max(least, min(tile["BLOCK_N"], n)), BLOCK_K=max(least, min(tile["BLOCK_K"], k)))
