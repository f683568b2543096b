"""The MoE and MLP kernels (layers/moe/, layers/mlp.py): each fast kernel against its torch oracle.

CPU (Triton interpreter, fp32, tiny shapes): routing ids equal, weights and gates <= 1e-6 (fp32 rounding of a
softmax and a division: a few ulps of values <= 1); expert outputs <= 1e-5 max abs on outputs of magnitude ~1-5
(fp32 GEMMs summed in another order; a wrong row, weight or expert is O(0.1)). The sorted layout is checked
directly (every local pair once, one expert per block, pads marked), and every builder but the one-program
_align_kernel (atomics place its rows) must equal align_torch's entry for entry: the chunked one with several
chunks (a partial last one, a group spanning all of them, an offsets scan in two steps), ranks with start > 0 and
fewer experts than E, no pair at all, one local expert. Shapes cover a TP=1 rank, middle and last ranks owning
part of the experts, a rank with no routed pair, every token on one expert, odd hidden/intermediate sizes, a
shared expert narrower than the routed ones (its TP=8 shard), and batch sizes 1..130. (The interpreter sorts one
element at a time, so the chunked layout at prefill sizes is checked on the GPU only.)

Decode kernels (T <= DECODE_MAX_T): down+combine within 1e-5 of its torch oracle and of the two-kernel path; the
whole block within 1e-5 of moe_torch on both sides of each threshold. The GEMV path (T <= GEMV_MAX_T: routing in the
gate_up kernel, no sorted layout): its routing bit for bit route_fast's (ids route_torch's exactly, ties to the
lowest ids), each pair's act row as gate_up_gemv_torch's and the act within 1e-5; T 1..8, E not a power of two,
ranks with start > 0, one with no local pair, a narrower shared expert. The scan path (a program per expert finding
its pairs in the routing): its pair -> row index exactly its twin's, act and down rows within 1e-5, 64 pairs of one
expert over several row blocks, and the path taken where a tile table says so.

GPU (`-m gpu`, bf16, Qwen3.5-35B-A3B shapes: 256 experts, top-8, hidden 2048, expert intermediate 512; shared
intermediate 512 at TP=1 and 64 per rank at TP=8 with 32 local experts): routing ids equal except at exact ties
(checked separately), weights within one bf16 ulp of values <= 1 (4e-3); expert outputs within 1e-2 relative
(Frobenius) of the oracle: both round every intermediate to bf16 where the reference does, so the difference is
fp32 accumulation order flipping some of those roundings (a few 1e-3); a wrong block or weight is > 0.1.
The chunked layout at T = 65..16384 (and chunks of 256..4096 pairs) exactly align_torch's. Repeated runs and
CUDA-graph replay (decode, the GEMV path at T = 1..8 included, and prefill) must give
identical bits.
"""
import functools
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from layers import backend, moe
from layers.activation import silu_mul_fast, silu_mul_torch
from layers.moe import block as moe_block, layout as moe_layout
from layers.mlp import MLP, mlp_fast, mlp_torch
from tests.compare import max_diff, rel

TOL_ROUTE = 1e-6
TOL = 1e-5


def make_weights(num_local, hidden, inter, shared_inter, start, gen, dtype=torch.float32, scale=0.2):
    """Random weights on gen's device."""
    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(dtype)
    return moe.ExpertWeights(rand(num_local, 2 * inter, hidden), rand(num_local, hidden, inter), start,
                             rand(2 * shared_inter, hidden), rand(hidden, shared_inter))


def make_routing(T, num_experts, top_k, gen, routed="any", device="cpu", dtype=torch.float32):
    """ids [T, k] (distinct per token), weights [T, k] summing to 1, shared gate [T, 1] in (0, 1).
    routed: "any" expert, "low" (only the first half: the upper ranks get nothing), "one" (every token on expert
    num_experts // 2 plus others)."""
    if routed == "one":
        rest = [torch.randperm(num_experts - 1, generator=gen)[:top_k - 1] for _ in range(T)]
        ids = torch.stack([torch.cat([torch.tensor([num_experts // 2]), r + (r >= num_experts // 2)]) for r in rest])
    else:
        high = num_experts // 2 if routed == "low" else num_experts
        ids = torch.stack([torch.randperm(high, generator=gen)[:top_k] for _ in range(T)])
    w = torch.rand(T, top_k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    gate = torch.sigmoid(torch.randn(T, 1, generator=gen))
    return ids.to(device), w.to(device, dtype), gate.to(device, dtype)


# ------------------------------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 12, 3), (37, 8, 2), (16, 64, 8)])
def test_route_fast_equals_torch(T, E, k):
    gen = torch.Generator().manual_seed(T * 100 + E)
    logits = torch.randn(T, E + 1, generator=gen) * 2
    ids, w, g = moe.route_torch(logits, k)
    fids, fw, fg = moe.route_fast(logits, k)
    assert torch.equal(fids.long(), ids)
    assert max_diff(fw, w) <= TOL_ROUTE and max_diff(fg, g) <= TOL_ROUTE
    assert torch.allclose(fw.sum(-1), torch.ones(T), atol=1e-6)
    assert torch.equal(ids, torch.topk(logits[:, :E], k).indices)  # no ties here: same as plain topk


def test_route_ties_go_to_lowest_id():
    """Logits with many exact ties: both implementations take the lowest ids among equal values."""
    gen = torch.Generator().manual_seed(7)
    T, E, k = 9, 16, 4
    logits = torch.randint(0, 3, (T, E + 1), generator=gen).float()
    ids, w, _ = moe.route_torch(logits, k)
    fids, fw, _ = moe.route_fast(logits, k)
    expected = torch.tensor([sorted(range(E), key=lambda e: (-logits[t, e].item(), e))[:k] for t in range(T)])
    assert torch.equal(ids, expected) and torch.equal(fids.long(), expected)
    assert max_diff(fw, w) <= TOL_ROUTE


# ------------------------------------------------------------------------------------------------ sorted layout
def check_layout(lay, ids, start, num_local, block_m):
    """Every local pair has exactly one row, inside a block of its expert and after the shared rows; pad rows are
    -1; other ranks' pairs map to -1; the blocks in use cover exactly `total` rows; each expert's group is
    ceil(count / block_m) blocks, in expert order."""
    T = ids.shape[0]
    total = int(lay.total)
    assert total % block_m == 0 and total <= lay.rows
    shared_rows = -(-T // block_m) * block_m
    blocks = lay.block_expert[: total // block_m].long()
    assert (blocks[: shared_rows // block_m] == num_local).all()
    flat = ids.flatten().long() - start
    mine = (flat >= 0) & (flat < num_local)
    counts = torch.bincount(flat[mine], minlength=num_local)
    group_blocks = torch.repeat_interleave(torch.arange(num_local, device=blocks.device), (counts + block_m - 1) // block_m)
    assert torch.equal(blocks[shared_rows // block_m:], group_blocks)  # each expert's group once, in order
    inv = lay.inverse.long()
    assert torch.equal(inv < 0, ~mine)
    rows = inv[mine]
    assert len(set(rows.tolist())) == len(rows) and bool((rows >= shared_rows).all())
    assert torch.equal(lay.sorted_pairs.long()[rows], mine.nonzero().squeeze(1))
    assert torch.equal(blocks[rows // block_m], flat[mine])
    routed_rows = torch.arange(shared_rows, total, device=inv.device)
    pads = routed_rows[~torch.isin(routed_rows, rows)]
    assert bool((lay.sorted_pairs[pads] == -1).all())
    assert len(pads) < block_m * max(1, len(blocks) - shared_rows // block_m)


def same_layout(a, b, T):
    """Entry for entry, where the kernels write: the block table and the routed rows in use, every pair's row."""
    total = int(b.total)
    shared_rows = -(-T // b.block_m) * b.block_m
    return (int(a.total) == total and a.rows == b.rows and torch.equal(a.inverse, b.inverse)
            and torch.equal(a.block_expert[: total // b.block_m], b.block_expert[: total // b.block_m])
            and torch.equal(a.sorted_pairs[shared_rows: total], b.sorted_pairs[shared_rows: total]))


@pytest.mark.parametrize("T,E,k,start,num_local,block_m", [(1, 8, 2, 0, 8, 16), (37, 8, 2, 2, 4, 16),
                                                          (20, 16, 4, 12, 4, 32), (9, 8, 2, 4, 4, 16),
                                                          (600, 8, 2, 0, 8, 16),        # groups of many blocks
                                                          (8192, 256, 8, 0, 256, 64),   # a full prefill step
                                                          (3000, 256, 8, 32, 32, 128)])  # TP=8 rank, BLOCK_M 128
def test_align_serial_layout(T, E, k, start, num_local, block_m):
    """The one-program layout and the torch one both hold; the torch one keeps each group's pairs in pair order.
    (The chunked layout at these sizes is checked on the GPU: the interpreter sorts one element at a time.)"""
    gen = torch.Generator().manual_seed(T + start)
    ids, _, _ = make_routing(T, E, k, gen, routed="low" if T == 9 else "any")
    check_layout(moe.align_serial(ids, start, num_local, block_m), ids, start, num_local, block_m)
    ref = moe.align_torch(ids, start, num_local, block_m)
    check_layout(ref, ids, start, num_local, block_m)
    routed = ref.sorted_pairs[-(-T // block_m) * block_m: int(ref.total)]
    expert = ref.block_expert[torch.arange(len(routed)) // block_m + -(-T // block_m)]
    pairs, expert = routed[routed >= 0], expert[routed >= 0]
    same = expert[1:] == expert[:-1]
    assert bool((pairs[1:][same] > pairs[:-1][same]).all())  # pair order within each group


CHUNKED_CASES = [  # T, E, k, start, num_local, block_m, chunk (pairs per program), routed
    (65, 8, 2, 0, 8, 16, 16, "any"),       # TP=1, 9 chunks, the last one partial
    (97, 16, 4, 12, 4, 16, 32, "any"),     # last rank: start > 0, num_local < E; 13 chunks
    (83, 12, 3, 3, 6, 32, 64, "one"),      # middle rank, 6 local experts (8 bins); one group over every chunk
    (70, 8, 2, 4, 4, 16, 16, "low"),       # no pair on this rank: every group empty, shared rows only
    (70, 8, 2, 5, 1, 16, 16, "any"),       # one local expert
    (150, 256, 8, 0, 256, 16, 64, "any"),  # TP=1's 256 bins: 16 chunks per offsets step, so 19 take two
    (129, 32, 4, 0, 32, 64, None, "any"),  # the default chunk (ALIGN_CHUNKS): 516 pairs in 5 chunks of 128
    (128, 256, 8, 0, 256, 16, None, "any"),  # a verify step of batch 64 at k = 1 at TP=1: 8 chunks of 128
]


@pytest.mark.parametrize("T,E,k,start,num_local,block_m,chunk,routed", CHUNKED_CASES)
def test_align_chunked_equals_torch(T, E, k, start, num_local, block_m, chunk, routed):
    """The chunked layout is align_torch's entry for entry (a group's pairs in pair order across chunks), on every
    run; check_layout holds for both."""
    gen = torch.Generator().manual_seed(T * 13 + start)
    ids, _, _ = make_routing(T, E, k, gen, routed)
    fast = moe.align_chunked(ids, start, num_local, block_m, chunk)
    ref = moe.align_torch(ids, start, num_local, block_m)
    check_layout(fast, ids, start, num_local, block_m)
    assert same_layout(fast, ref, T)
    if routed == "low":
        assert int(fast.total) == -(-T // block_m) * block_m and bool((fast.inverse == -1).all())


def test_align_switches_at_threshold():
    """align_fast: one program up to ALIGN_SERIAL_MAX_T tokens (its own row order), the chunked kernels above (exactly
    align_torch's); both complete layouts."""
    gen = torch.Generator().manual_seed(3)
    for T in (moe.ALIGN_SERIAL_MAX_T, moe.ALIGN_SERIAL_MAX_T + 1):
        ids, _, _ = make_routing(T, 8, 2, gen)
        lay = moe.align_fast(ids, 2, 4, 16)
        check_layout(lay, ids, 2, 4, 16)
        if T > moe.ALIGN_SERIAL_MAX_T:
            assert same_layout(lay, moe.align_torch(ids, 2, 4, 16), T)


# ------------------------------------------------------------------------------------------------------ experts
EXPERT_CASES = [  # T, E, k, H, I, I_s, start, num_local, routed
    (37, 8, 2, 32, 16, 16, 0, 8, "any"),    # TP=1: shared expert as wide as the routed ones
    (37, 8, 2, 48, 24, 12, 2, 4, "any"),    # a middle rank, odd sizes, shared expert half as wide (its TP shard)
    (1, 8, 2, 32, 16, 8, 6, 2, "any"),      # one token, last rank
    (9, 8, 2, 32, 16, 16, 0, 8, "one"),     # every token on expert 4
    (9, 8, 2, 32, 16, 8, 4, 4, "low"),      # no routed pair on this rank: shared expert only
    (3, 16, 4, 40, 48, 16, 4, 8, "any"),    # routed experts wider than 32, k = 4
]


@pytest.mark.parametrize("T,E,k,H,I,I_s,start,num_local,routed", EXPERT_CASES)
def test_experts_fast_equals_torch(T, E, k, H, I, I_s, start, num_local, routed):
    gen = torch.Generator().manual_seed(T * 7 + start)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x = torch.randn(T, H, generator=gen)
    ids, wts, gate = make_routing(T, E, k, gen, routed)
    ref = moe.experts_torch(x, ids, wts, gate, w)
    fast = moe.experts_fast(x, ids, wts, gate, w)
    assert ref.abs().max() > 0.3 and torch.isfinite(fast).all()
    assert max_diff(fast, ref) <= TOL
    if routed == "low":  # only the shared expert contributes on this rank
        shared = gate * mlp_torch(x, w.shared_gate_up, w.shared_down)
        assert max_diff(ref, shared) <= TOL


def test_experts_fast_int32_ids_deterministic_and_padding_free():
    """Route ids as route_fast gives them (int32); two runs give the same bits; rows added past the batch (graph
    padding: they route like any token) leave the real rows' outputs unchanged."""
    gen = torch.Generator().manual_seed(5)
    w = make_weights(8, 32, 16, 16, 0, gen)
    x = torch.randn(8, 32, generator=gen)
    ids, wts, gate = make_routing(8, 8, 2, gen)
    a = moe.experts_fast(x[:5], ids[:5].int(), wts[:5], gate[:5], w)
    b = moe.experts_fast(x[:5], ids[:5].int(), wts[:5], gate[:5], w)
    padded = moe.experts_fast(x, ids.int(), wts, gate, w)
    assert torch.equal(a, b)
    assert max_diff(padded[:5], a) <= 1e-6


@pytest.mark.parametrize("T,E,k,H,I,I_s,start,num_local,routed", EXPERT_CASES)
def test_grouped_steps_fast_equal_torch(T, E, k, H, I, I_s, start, num_local, routed):
    """Each grouped kernel against its torch twin on the same inputs and the layout align_fast builds (the
    one-program builder's row order included), on the entries the kernel writes (gate_up: the shared rows and the
    routed rows in use; down: the valid rows; combine: all) within TOL, with tiles of several N and K steps; chained,
    the twins give experts_torch's output within TOL."""
    gen = torch.Generator().manual_seed(T * 5 + start)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x = torch.randn(T, H, generator=gen)
    ids, wts, gate = make_routing(T, E, k, gen, routed)
    lay = moe.align_fast(ids, start, num_local, 16)
    tile = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
    rows = lay.inverse[lay.inverse >= 0].long()  # the routed rows in use
    assert not len(rows) if routed == "low" else len(rows) or T == 1  # (one token may miss this rank's experts)
    act = moe.gate_up_torch(x, w, lay)
    fast_act = moe.gate_up_fast(x, w, lay, tile)
    assert act[:T, :I_s].abs().max() > 0.1 and max_diff(fast_act[:T, :I_s], act[:T, :I_s]) <= TOL
    assert not len(rows) or (act[rows, :I].abs().max() > 0.1 and max_diff(fast_act[rows, :I], act[rows, :I]) <= TOL)
    y = moe.down_torch(act, w, lay, wts, gate)
    fast_y = moe.down_fast(act, w, lay, wts, gate, tile)
    assert max_diff(fast_y[:T], y[:T]) <= TOL and (not len(rows) or max_diff(fast_y[rows], y[rows]) <= TOL)
    out = moe.combine_torch(y, lay.inverse, T)
    assert max_diff(moe.combine_fast(y, lay.inverse, T), out) <= TOL
    assert out.abs().max() > 0.05 and max_diff(out, moe.experts_torch(x, ids, wts, gate, w)) <= TOL


# ---------------------------------------------------------------------------------------- decode down+combine
@pytest.mark.parametrize("T,E,k,H,I,I_s,start,num_local,routed", [c for c in EXPERT_CASES if c[0] <= 9])
def test_down_combine_fast_equals_torch(T, E, k, H, I, I_s, start, num_local, routed):
    """On the layout and act of the decode path: the one-kernel down+combine against its torch oracle and against
    the two-kernel path (down, combine), and the whole experts step against experts_torch."""
    gen = torch.Generator().manual_seed(T * 11 + start)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x = torch.randn(T, H, generator=gen)
    ids, wts, gate = make_routing(T, E, k, gen, routed)
    lay = moe.align_torch(ids, start, num_local, 16)
    act = moe.gate_up_fast(x, w, lay, moe.moe_config(T, num_local, H, I, I_s, x.device)["gate_up"])
    tile = dict(BLOCK_N=8, BLOCK_K=16, num_warps=2, num_stages=3)  # several N tiles and K steps here
    fast = moe.down_combine_fast(act, w, lay.inverse, ids.int(), wts, gate, tile)
    want = moe.down_combine_torch(act, w, lay.inverse, ids, wts, gate)
    assert want.abs().max() > 0.3 and max_diff(fast, want) <= TOL
    two = moe.combine_fast(moe.down_fast(act, w, lay, wts, gate, dict(BLOCK_N=16, BLOCK_K=16, num_warps=4,
                                                                      num_stages=2)), lay.inverse, T)
    assert max_diff(fast, two) <= TOL
    assert max_diff(moe.down_combine_fast(act, w, lay.inverse, ids.int(), wts, gate), want) <= TOL  # default tile
    assert max_diff(fast, moe.experts_torch(x, ids, wts, gate, w)) <= TOL


# ------------------------------------------------------------------------------------------- decode GEMV path
GEMV_CASES = [  # T, E, k, H, I, I_s, start, num_local, routed
    (1, 8, 2, 32, 16, 8, 0, 8, "any"),       # one token, TP=1, shared expert narrower (its TP shard)
    (2, 12, 3, 40, 24, 24, 4, 4, "any"),     # E not a power of two, a middle rank, odd sizes
    (3, 16, 4, 32, 16, 8, 8, 8, "any"),      # last rank, k = 4
    (8, 10, 2, 48, 16, 16, 5, 5, "any"),     # GEMV_MAX_T; E = 10, last rank
    (3, 8, 2, 32, 16, 8, 4, 4, "low"),       # no local pair: shared expert only
]


def gemv_inputs(T, E, H, gen, routed):
    """x [T, H] and router [E + 1, H]; routed "low": x's column 0 is 10 and the router's is +3 for the first half of
    the experts, -3 for the rest, so every token's top k (k <= E / 2) lies in the first half."""
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E + 1, H, generator=gen) * 0.3
    if routed == "low":
        x[:, 0] = 10.0
        router[:E, 0] = torch.where(torch.arange(E) < E // 2, 3.0, -3.0)
    return x, router


@pytest.mark.parametrize("T,E,k,H,I,I_s,start,num_local,routed", GEMV_CASES)
def test_gate_up_gemv_equals_torch(T, E, k, H, I, I_s, start, num_local, routed):
    """The GEMV path's gate_up (the per-token kernel: default tile, several N tiles and H steps, summed along K a
    step or after the loop; the persistent kernel: whole rows, several items a program, pipelined): routing bit
    for bit route_fast's (ids exactly route_torch's, weights and gate within TOL_ROUTE), each pair's row as the
    oracle's, act rows of local pairs and the shared rows within TOL; down_combine on it, and the whole path,
    against the oracles."""
    gen = torch.Generator().manual_seed(T * 17 + start)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x, router = gemv_inputs(T, E, H, gen, routed)
    logits = F.linear(x, router)
    ref = moe.gate_up_gemv_torch(x, logits, k, w)
    for tile in (moe.GEMV_TILE, dict(BLOCK_N=4, BLOCK_K=16, num_warps=2, num_stages=3),
                 dict(BLOCK_N=4, BLOCK_K=16, num_warps=2, num_stages=3, sum_last=True), dict(persistent=True),
                 dict(persistent=True, BLOCK_N=2, num_stages=2, num_warps=2, per_sm=1)):
        fast = moe.gate_up_gemv_fast(x, logits, k, w, tile)
        assert fast.ids.dtype == torch.int32 and torch.equal(fast.ids.long(), ref.ids)
        assert all(torch.equal(a, b) for a, b in zip(fast[1:4], moe.route_fast(logits, k)))
        assert max_diff(fast.weights, ref.weights) <= TOL_ROUTE
        assert max_diff(fast.shared_gate, ref.shared_gate) <= TOL_ROUTE
        assert torch.equal(fast.inverse, ref.inverse)
        mine = fast.inverse[fast.inverse >= 0].long()
        assert (len(mine) > 0) == (routed == "any")
        assert max_diff(fast.act[:T, :I_s], ref.act[:T, :I_s]) <= TOL
        assert not len(mine) or max_diff(fast.act[mine, :I], ref.act[mine, :I]) <= TOL
    out = moe.down_combine_fast(fast.act, w, fast.inverse, fast.ids, fast.weights, fast.shared_gate)
    oracle = moe.down_combine_torch(ref.act, w, ref.inverse, ref.ids, ref.weights, ref.shared_gate)
    assert max_diff(out, oracle) <= TOL
    want = moe.moe_torch(x, router, k, w)
    assert want.abs().max() > 0.1 and max_diff(moe.decode_path(x, router, k, w, gemv=True), want) <= TOL


def test_gate_up_gemv_tuned_tiles_compile_for_hopper():
    """Every tile of the tuned table's GEMV path that sums along K after its loop (sum_last, more registers) compiles
    for sm_90 in bf16 at the 35B-A3B's shape (8 of 256 experts, H 2048), as its launch records it."""
    import json

    from layers.moe.tiles import CONFIG_FILE
    from tests.hopper_compile import compile_all, hopper_backend_available, recorded, variant
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    gen = torch.Generator().manual_seed(0)
    w = make_weights(16, 64, 32, 32, 0, gen, torch.bfloat16)
    x, router = gemv_inputs(2, 16, 64, gen, "any")
    with recorded() as launches:
        moe.gate_up_gemv_fast(x.bfloat16(), F.linear(x, router).bfloat16(), 8, w,
                              dict(BLOCK_N=4, BLOCK_K=16, num_warps=2, num_stages=3, sum_last=True))
    launch = next(e for e in launches if e["name"] == "_gate_up_gemv_kernel")
    tiles = [entry["gemv"] for shapes in json.load(open(CONFIG_FILE)).values() for buckets in shapes.values()
             for entry in buckets.values() if (entry.get("gemv") or {}).get("sum_last")]
    assert tiles
    assert compile_all([variant(launch, {"num_warps": tile["num_warps"]}, TOP_K=8, K_POW2=8, BLOCK_E=256,
                                BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"], NUM_STAGES=tile["num_stages"],
                                SUM_LAST=True) for tile in tiles]) == []


def test_gate_up_gemv_ties_go_to_lowest_id():
    """Integer logits with many exact ties: the lowest ids among equal values, as route_fast and route_torch."""
    gen = torch.Generator().manual_seed(7)
    T, E, k, H = 5, 16, 4, 32
    logits = torch.randint(0, 3, (T, E + 1), generator=gen).float()
    w = make_weights(8, H, 16, 8, 4, gen)
    x = torch.randn(T, H, generator=gen)
    fast = moe.gate_up_gemv_fast(x, logits, k, w)
    expected = torch.tensor([sorted(range(E), key=lambda e: (-logits[t, e].item(), e))[:k] for t in range(T)])
    assert any(len(set(logits[t, :E].tolist())) < E for t in range(T))
    assert torch.equal(fast.ids.long(), expected) and torch.equal(fast.ids, moe.route_fast(logits, k)[0])
    assert torch.equal(fast.inverse, moe.gate_up_gemv_torch(x, logits, k, w).inverse)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 16])
def test_moe_fast_reads_a_pending_norm(T, monkeypatch):
    """At decode sizes the block's input is a layer norm not yet computed (RMSNorm.boundary): the router GEMV
    computes it (from 3 tokens its row grid, a program per column block and token), the experts read the rows it
    stored, and no norm kernel runs; the same bits as the block on the norm computed first. (The router's 9
    programs here are more than 2 per SM of the 4 the CPU counts: the limit is raised so that 2 tokens fold too, as
    the real router's 257 programs on 132 SMs do.)"""
    from layers import linear
    from layers.norm import RMSNorm

    monkeypatch.setattr(linear, "FOLD_MAX_PROGRAMS_PER_SM", 4)

    gen = torch.Generator().manual_seed(T)
    w = make_weights(8, 32, 16, 8, 0, gen)
    x, res = torch.randn(T, 32, generator=gen), torch.randn(T, 32, generator=gen)
    router = torch.randn(9, 32, generator=gen) * 0.3
    with backend.use_kernels("fast"):
        norm = RMSNorm(32, 1e-6)
    norm.weight.data.copy_(torch.randn(32, generator=gen) * 0.2)
    h, total = norm(x, res)
    pending, pending_total = norm.boundary(x, res)
    pending.compute = lambda p: pytest.fail("the norm kernel ran: the router GEMV should have computed it")
    assert torch.equal(moe.moe_fast(pending, router, 2, w), moe.moe_fast(h, router, 2, w))
    assert torch.equal(pending.out, h) and torch.equal(pending_total, total)


def test_moe_fast_takes_gemv_up_to_threshold(monkeypatch):
    """Without a tuned table, moe_fast takes the GEMV path exactly up to GEMV_MAX_T tokens; both sides match
    moe_torch."""
    calls, real = [], moe.gate_up_gemv_fast

    def spy(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)
    monkeypatch.setattr(moe_block, "gate_up_gemv_fast", spy)
    gen = torch.Generator().manual_seed(2)
    w = make_weights(4, 32, 16, 8, 4, gen)
    router = torch.randn(13, 32, generator=gen) * 0.3
    for T in (moe.GEMV_MAX_T, moe.GEMV_MAX_T + 1):
        x = torch.randn(T, 32, generator=gen)
        assert max_diff(moe.moe_fast(x, router, 3, w), moe.moe_torch(x, router, 3, w)) <= TOL
    assert calls == [moe.GEMV_MAX_T]


# ------------------------------------------------------------------------------------------- decode scan path
SCAN_TILES = [  # (gate_up, down): the defaults; several N tiles and K steps
    (None, None),
    (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2),
     dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)),
]


@pytest.mark.parametrize("T,E,k,H,I,I_s,start,num_local,routed", EXPERT_CASES + [
    (64, 16, 4, 32, 16, 16, 0, 16, "one")])  # DECODE_MAX_T, 64 pairs on one expert: 4 row blocks of 16
def test_scan_steps_equal_torch(T, E, k, H, I, I_s, start, num_local, routed):
    """The scan path's kernels (a program per expert finding its pairs in the routing) against their torch twins
    on the same inputs: gate_up_scan's pair -> row index exactly, its act rows (shared, and the local pairs') within
    TOL; down_scan's rows within TOL; combine on them, and down_combine on the scan's act, give experts_torch's output
    within TOL. Tiles: the defaults, and several N tiles with several K steps."""
    gen = torch.Generator().manual_seed(T * 13 + start)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x = torch.randn(T, H, generator=gen)
    ids, wts, gate = make_routing(T, E, k, gen, routed)
    ids = ids.int()
    ref = moe.gate_up_scan_torch(x, ids, wts, gate, w)
    mine = ref.inverse[ref.inverse >= 0].long()
    assert (len(mine) > 0) == (routed != "low")
    want = moe.experts_torch(x, ids.long(), wts, gate, w)
    assert want.abs().max() > 0.05
    for up_tile, down_tile in SCAN_TILES:
        g = moe.gate_up_scan_fast(x, ids, wts, gate, w, up_tile)
        assert torch.equal(g.inverse, ref.inverse)
        assert max_diff(g.act[:T, :I_s], ref.act[:T, :I_s]) <= TOL
        assert not len(mine) or max_diff(g.act[mine, :I], ref.act[mine, :I]) <= TOL
        y_ref = moe.down_scan_torch(g.act, w, g.inverse, ids, wts, gate)
        y = moe.down_scan_fast(g.act, w, g.inverse, ids, wts, gate, down_tile)
        assert max_diff(y[:T], y_ref[:T]) <= TOL and (not len(mine) or max_diff(y[mine], y_ref[mine]) <= TOL)
        out = moe.combine_fast(y, g.inverse, T)
        assert max_diff(out, moe.combine_torch(y_ref, g.inverse, T)) <= TOL and max_diff(out, want) <= TOL
        assert max_diff(moe.down_combine_fast(g.act, w, g.inverse, ids, wts, gate), want) <= TOL


def test_moe_fast_takes_the_scan_path_where_the_table_says(monkeypatch):
    """A tile table entry with "scan" (and no "gemv") sends moe_fast down the scan path, its "down" tile choosing
    down_scan + combine (a tile) or down_combine (None); both match moe_torch."""
    calls = []
    real_up, real_down = moe.gate_up_scan_fast, moe.down_scan_fast
    monkeypatch.setattr(moe_block, "gate_up_scan_fast", lambda *a: calls.append("up") or real_up(*a))
    monkeypatch.setattr(moe_block, "down_scan_fast", lambda *a: calls.append("down") or real_down(*a))
    gen = torch.Generator().manual_seed(5)
    w = make_weights(8, 32, 16, 8, 0, gen)
    router = torch.randn(9, 32, generator=gen) * 0.3
    x = torch.randn(12, 32, generator=gen)
    want = moe.moe_torch(x, router, 2, w)
    for down, expect in ((dict(moe.SCAN_DOWN_TILE), ["up", "down"]), (None, ["up"])):
        cfg = dict(moe.config_for(x, w), gemv=None, scan={"gate_up": dict(moe.SCAN_GATE_UP_TILE), "down": down},
                   down_combine=dict(moe.DOWN_COMBINE_TILE))
        monkeypatch.setattr(moe_block, "config_for", lambda *a, cfg=cfg: cfg)
        calls.clear()
        assert max_diff(moe.moe_fast(x, router, 2, w), want) <= TOL
        assert calls == expect


# ------------------------------------------------------------------------------------------------- the block
BLOCK_CASES = [  # T, E, k, H, I, I_s, start, num_local
    (1, 8, 2, 32, 16, 8, 6, 2),       # one token, last rank, shared expert narrower
    (3, 16, 4, 40, 24, 24, 4, 8),     # middle rank, odd sizes
    (8, 8, 2, 32, 16, 16, 0, 8),      # DOWN_COMBINE_MAX_T
    (9, 12, 3, 32, 16, 8, 8, 4),      # just past it: down + combine in two kernels
    (37, 8, 2, 32, 16, 16, 2, 4),     # three token blocks
    (64, 16, 4, 32, 16, 16, 0, 16),   # DECODE_MAX_T
    (65, 8, 2, 32, 16, 16, 4, 4),     # just past it: the grouped path with route_fast and the chunked layout
    (130, 16, 4, 32, 16, 8, 4, 8),    # 520 pairs in 9 chunks of 64 (ALIGN_CHUNKS made small here)
]


@pytest.mark.parametrize("T,E,k,H,I,I_s,start,num_local", BLOCK_CASES)
def test_moe_fast_equals_torch(T, E, k, H, I, I_s, start, num_local, monkeypatch):
    """The whole block: moe_fast (which picks its kernels by T: the GEMV path up to GEMV_MAX_T, route_fast + the
    one-program align up to DECODE_MAX_T, the chunked layout above) and, where they apply, the decode paths it did not
    take (the layout's with the other down+combine choice; the layout's or the GEMV one; the scan path with either
    down step), against moe_torch."""
    monkeypatch.setattr(moe_layout, "ALIGN_CHUNKS", ((float("inf"), 64),))  # several chunks at interpreter sizes
    gen = torch.Generator().manual_seed(T + E)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E + 1, H, generator=gen) * 0.3
    want = moe.moe_torch(x, router, k, w)
    assert want.abs().max() > 0.3
    assert max_diff(moe.moe_fast(x, router, k, w), want) <= TOL
    if T <= moe.DECODE_MAX_T:
        other = T > moe.DOWN_COMBINE_MAX_T
        forced = moe.decode_path(x, router, k, w, down_combine=other, gemv=False)
        assert max_diff(forced, want) <= TOL
        assert max_diff(moe.decode_path(x, router, k, w, gemv=T > moe.GEMV_MAX_T), want) <= TOL
        for down_combine in (True, False):
            assert max_diff(moe.decode_path(x, router, k, w, down_combine, gemv=False, scan=True), want) <= TOL


def test_decode_path_runs_the_entry_it_is_given():
    """decode_path(cfg=entry_config(...)) runs that entry's path and tiles, not the table's (the tuner's confirm times
    two entries this way): no GEMV or scan entry is the sorted layout (down + combine in two kernels where the entry
    says so), bit for bit the forced call on the same default tiles; a GEMV entry the GEMV path."""
    T, E, k, H, I, I_s, start, num_local = 3, 16, 4, 40, 24, 24, 4, 8
    gen = torch.Generator().manual_seed(5)
    w = make_weights(num_local, H, I, I_s, start, gen)
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E + 1, H, generator=gen) * 0.3
    want = moe.moe_torch(x, router, k, w)
    sorted_two = moe.entry_config(T, {"gemv": None, "scan": None, "down_combine": None}, H, I, I_s)
    got = moe.decode_path(x, router, k, w, cfg=sorted_two)
    assert torch.equal(got, moe.decode_path(x, router, k, w, down_combine=False, gemv=False, scan=False))
    gemv = moe.entry_config(T, {"gemv": dict(moe.GEMV_TILE, BLOCK_N=8), "scan": None}, H, I, I_s)
    assert moe.default_config(T)["gemv"] != gemv["gemv"]
    assert max_diff(moe.decode_path(x, router, k, w, cfg=gemv), want) <= TOL
    g = moe.gate_up_gemv_fast(x, moe.router_logits_fast(x, router), k, w, gemv["gemv"])
    assert torch.equal(moe.decode_path(x, router, k, w, cfg=gemv),
                       moe.down_combine_fast(g.act, w, g.inverse, g.ids, g.weights, g.shared_gate))


def test_moe_fast_padding_and_repeat():
    """Rows added past the batch (graph padding: 5 tokens run as 8) leave the real rows' outputs as they were, and
    a second run gives the same bits (no atomics decide a value)."""
    gen = torch.Generator().manual_seed(11)
    w = make_weights(4, 32, 16, 8, 4, gen)
    x = torch.randn(8, 32, generator=gen)
    router = torch.randn(13, 32, generator=gen) * 0.3
    a = moe.moe_fast(x[:5], router, 3, w)
    assert torch.equal(moe.moe_fast(x[:5], router, 3, w), a)
    assert max_diff(moe.moe_fast(x, router, 3, w)[:5], a) <= 1e-6


# ------------------------------------------------------------------------------------------------------- layers
def tiny_cfg(**kw):
    base = dict(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=16)
    return SimpleNamespace(**{**base, **kw})


def build(cls, kernels, *args, seed=0, **kw):
    with backend.use_kernels(kernels):
        m = cls(*args, dtype=torch.float32, **kw)
    gen = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)  # in place: fused views stay views
    return m


@pytest.mark.parametrize("T", [1, 4, 13])
def test_sparse_moe_fast_equals_torch(T):
    """The whole block, both kernel sets on the same weights; the one-GEMM router and shared gate|up read the
    parameters the loader fills (views), and `sync_free` tells which set may be graph-captured."""
    cfg = tiny_cfg()
    ref, fast = build(moe.SparseMoE, "torch", cfg), build(moe.SparseMoE, "fast", cfg)
    assert not ref.sync_free and fast.sync_free and fast.experts.sync_free
    assert torch.equal(fast.router[:8], fast.gate.weight) and torch.equal(fast.router[8:], fast.shared_expert_gate.weight)
    assert fast.router.data_ptr() == fast.gate.weight.data_ptr()
    assert fast.shared_expert.gate_up.data_ptr() == fast.shared_expert.gate_proj.weight.data_ptr()
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(T))
    want = ref(x)
    assert want.abs().max() > 0.3
    assert max_diff(fast(x), want) <= TOL


def test_padded_router_gemm():
    """SparseMoE's router buffer is padded to a multiple of ROUTER_PAD_ROWS zero rows; padded_router_gemm runs its GEMM
    over them and returns exactly F.linear's [T, E + 1] (same columns, one GEMM), as a view; a router without spare
    rows (or not contiguous) takes the plain GEMM."""
    m = build(moe.SparseMoE, "fast", tiny_cfg())
    E1, H = m.router.shape
    assert E1 == 9 and m.router.untyped_storage().nbytes() == 16 * H * m.router.element_size()
    x = torch.randn(70, H, generator=torch.Generator().manual_seed(1))
    got = moe.padded_router_gemm(x, m.router)
    assert got.shape == (70, E1) and got.stride() == (16, 1)
    assert max_diff(got, F.linear(x, m.router)) <= 1e-5
    plain = torch.randn(E1, H)
    assert moe.padded_router_gemm(x, plain).stride() == (E1, 1)
    assert moe.padded_router_gemm(x, m.router.t().contiguous().t()).stride() == (E1, 1)


@pytest.mark.parametrize("T,H,I,bias", [(1, 32, 16, False), (2, 40, 37, True), (7, 48, 40, True),
                                         (17, 48, 40, False)])
def test_mlp_fast_equals_torch(T, H, I, bias):
    """The GEMV's rows (1, 2), the rows kernel's (7), past them (17), with and without mlp_bias; I = 37 not a
    multiple of any tile."""
    torch_mlp, fast_mlp = build(MLP, "torch", H, I, bias=bias), build(MLP, "fast", H, I, bias=bias)
    assert fast_mlp.gate_up.shape == (2 * I, H) and fast_mlp.sync_free
    assert torch.equal(fast_mlp.gate_up[I:], fast_mlp.up_proj.weight)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    want = torch_mlp(x)
    manual = torch_mlp.down_proj(torch.nn.functional.silu(torch_mlp.gate_proj(x)) * torch_mlp.up_proj(x))
    assert max_diff(want, manual) <= TOL
    assert max_diff(fast_mlp(x), want) <= TOL
    if not bias:
        assert max_diff(mlp_fast(x, fast_mlp.gate_up, fast_mlp.down_proj.weight), want) <= TOL


@pytest.mark.parametrize("T,launches", [(1, ["_gemv_kernel"] * 2), (2, ["_gemv_kernel"] * 2),
                                        (7, ["_rows_kernel"] * 2), (17, ["_silu_mul_kernel"])])
def test_mlp_fast_launches(T, launches, monkeypatch):
    """Up to ROWS_MAX_M rows the dense MLP is two launches: gate_up with silu(gate) * up in its epilogue, then down
    (the GEMV's or the rows kernel's); past them F.linear, silu_mul_fast's kernel, F.linear."""
    from triton.runtime.interpreter import InterpretedFunction
    met, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **kw: (met.append(self.fn.__name__),
                                                                            run(self, *a, **kw))[1])
    build(MLP, "fast", 32, 24)(torch.randn(T, 32))
    assert met == launches


@pytest.mark.parametrize("shape", [(1, 32), (7, 80), (3, 2, 2100)])
def test_silu_mul_fast_equals_torch(shape):
    """silu(gate half) * up half: the kernel (several column blocks at 2 x 1050, leading dims flattened) within
    1e-6 of the torch twin relative to the largest output (fp32: a few ulps, as sigmoid's last bits differ)."""
    h = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])) * 3
    want = silu_mul_torch(h)
    assert want.shape == (*shape[:-1], shape[-1] // 2) and want.abs().max() > 1
    assert max_diff(silu_mul_fast(h), want) <= 1e-6 * want.abs().max()


# ------------------------------------------------------------------------------------------------- tile configs
def test_padded_graph_batches_share_tiles():
    """A decode batch and its CUDA-graph padding (the decode and the verify graphs' sizes) get the same tiles, hence
    the same bits; tiles never exceed the (power-of-two rounded) matrices."""
    from qwen35.cuda_graphs import capture_sizes, verify_sizes
    for T, sizes in itertools.product(range(1, 129), (capture_sizes(128), verify_sizes(128))):
        padded = next(s for s in sizes if s >= T)
        assert moe.moe_config(T, 32, 2048, 512, 64, torch.device("cpu")) == \
            moe.moe_config(padded, 32, 2048, 512, 64, torch.device("cpu"))
    cpu = torch.device("cpu")  # no table: down + combine in one kernel exactly up to DOWN_COMBINE_MAX_T
    assert moe.moe_config(moe.DOWN_COMBINE_MAX_T, 32, 2048, 512, 64, cpu)["down_combine"] is not None
    assert moe.moe_config(moe.DOWN_COMBINE_MAX_T + 1, 32, 2048, 512, 64, cpu)["down_combine"] is None
    assert moe.moe_config(moe.GEMV_MAX_T, 32, 2048, 512, 64, cpu)["gemv"] is not None  # the GEMV path likewise
    assert moe.moe_config(moe.GEMV_MAX_T + 1, 32, 2048, 512, 64, cpu)["gemv"] is None
    tiny = moe.moe_config(3000, 4, 40, 24, 8, torch.device("cpu"))
    assert tiny["gate_up"]["BLOCK_N"] <= 32 and tiny["down"]["BLOCK_K"] <= 32 and tiny["gate_up"]["BLOCK_K"] <= 64


def test_tuned_buckets_between_powers_of_two(monkeypatch):
    """A tuned table may hold buckets that are decode graph sizes between powers of two (tune_moe --batches 24): T
    takes the smallest tuned bucket >= T, so 17-24 take 24's entry, 25-32 32's, past the largest the largest; a
    decode batch and its graph padding still share a bucket."""
    from layers.moe import tiles
    from qwen35.cuda_graphs import capture_sizes
    table = {"16": {"BLOCK_M": 16}, "20": {"BLOCK_M": 20}, "24": {"BLOCK_M": 24}, "32": {"BLOCK_M": 32},
             "48": {"BLOCK_M": 48}}
    monkeypatch.setattr(tiles, "tuned_entries", lambda device, key: table)
    tiles._moe_config.cache_clear()
    try:
        cpu = torch.device("cpu")
        got = {T: moe.moe_config(T, 32, 2048, 512, 64, cpu)["BLOCK_M"] for T in range(1, 65)}
        assert [got[T] for T in (1, 16, 17, 20, 21, 24, 25, 32, 33, 48, 49, 64)] == \
            [16, 16, 20, 20, 24, 24, 32, 32, 48, 48, 48, 48]
        sizes = capture_sizes(64)
        assert all(got[T] == got[next(s for s in sizes if s >= T)] for T in range(1, 65))
        w = SimpleNamespace(gate_up=torch.empty(32, 1024, 2048), down=torch.empty(32, 2048, 512))
        assert moe.token_buckets(40, w, cpu) == [1, 2, 4, 8, 16, 20, 24, 32]  # what a warm-up meets
        assert moe.token_buckets(64, w, cpu)[-3:] == [32, 48, 64]
    finally:
        tiles._moe_config.cache_clear()


def test_max_rows_is_an_upper_bound():
    """The padded rows of any routing fit: skewed routings (from uniform to nearly all tokens on a few experts)
    make many small groups or a few full ones."""
    gen = torch.Generator().manual_seed(0)
    for T, k, num_local, block_m in [(1, 8, 256, 16), (64, 8, 32, 16), (300, 8, 256, 64), (5, 2, 3, 16)]:
        E = num_local * 2
        for skew in (0.0, 0.5, 2.0, 8.0):
            popularity = torch.exp(-skew * torch.arange(E, dtype=torch.float32) / 4)
            ids = torch.stack([torch.multinomial(popularity, k, generator=gen) for _ in range(T)])
            counts = torch.bincount(ids.flatten(), minlength=E)[:num_local]
            need = -(-T // block_m) * block_m + int(((counts + block_m - 1) // block_m * block_m).sum())
            assert need <= moe.max_rows(T, k, num_local, block_m)


# ------------------------------------------------------------------------------------------------------- GPU
@functools.lru_cache(maxsize=None)
def real_weights(tp: int) -> moe.ExpertWeights:
    """A rank's weights of Qwen3.5-35B-A3B at TP=tp (all 256 experts, each and the shared expert with 512 // tp
    intermediate rows: layers/moe/experts.py), bf16, std 0.02, made on the GPU once per degree."""
    gen = torch.Generator(device="cuda").manual_seed(tp)
    return make_weights(256, 2048, 512 // tp, 512 // tp, 0, gen, torch.bfloat16, scale=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_route_fast_bf16(T):
    gen = torch.Generator().manual_seed(T)
    logits = (torch.randn(T, 257, generator=gen) * 2).to("cuda", torch.bfloat16)
    ids, w, g = moe.route_torch(logits, 8)
    fids, fw, fg = moe.route_fast(logits, 8)
    probs = torch.softmax(logits[:, :256].float(), -1)
    assert torch.equal(fids.long(), ids)  # both take the lowest id among ties
    assert torch.equal(probs.gather(1, fids.long()), probs.gather(1, ids))
    assert max_diff(fw, w) <= 4e-3 and max_diff(fg, g) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("T,chunk", [(65, None), (1024, None), (8192, None), (8192, 256), (8192, 4096),
                                     (16384, None)])
def test_align_chunked_bf16_real_shapes(tp, T, chunk):
    """The chunked layout at prefill sizes (ids routed from bf16 logits, BLOCK_M from the config): align_torch's
    entry for entry, on every run; and align, which takes it above ALIGN_SERIAL_MAX_T."""
    w = real_weights(tp)
    num_local = w.gate_up.shape[0]
    gen = torch.Generator().manual_seed(T + tp)
    ids = moe.route_fast((torch.randn(T, 257, generator=gen) * 2).to("cuda", torch.bfloat16), 8)[0]
    block_m = moe.moe_config(T, num_local, 2048, 512 // tp, 512 // tp, ids.device)["BLOCK_M"]
    ref = moe.align_torch(ids, w.start, num_local, block_m)
    fast = moe.align_chunked(ids, w.start, num_local, block_m, chunk)
    check_layout(fast, ids, w.start, num_local, block_m)
    assert same_layout(fast, ref, T) and same_layout(moe.align_chunked(ids, w.start, num_local, block_m, chunk), ref, T)
    assert same_layout(moe.align_fast(ids, w.start, num_local, block_m), ref, T)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_experts_fast_prefill_bits_and_graph_replay(tp):
    """The prefill path (chunked layout, grouped kernels) gives the same bits on every run and from a CUDA graph
    replayed on new inputs."""
    w, router = real_weights(tp), real_router(tp)
    gen = torch.Generator().manual_seed(30 + tp)
    x = torch.randn(1024, 2048, generator=gen).to("cuda", torch.bfloat16)
    eager = moe.moe_fast(x, router, 8, w)
    assert torch.equal(moe.moe_fast(x, router, 8, w), eager)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_fast(static, router, 8, w)
    x2 = torch.randn(1024, 2048, generator=gen).to("cuda", torch.bfloat16)
    static.copy_(x2)
    graph.replay()
    assert torch.equal(out, moe.moe_fast(x2, router, 8, w))


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 300, 2048, 8192])  # 8192: a prefill step (large-M tiles)
def test_experts_fast_bf16_real_shapes(tp, T):
    w = real_weights(tp)
    gen = torch.Generator().manual_seed(T + tp)
    x = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
    ids, wts, gate = make_routing(T, 256, 8, gen, device="cuda", dtype=torch.bfloat16)
    ref = moe.experts_torch(x, ids, wts, gate, w)
    fast = moe.experts_fast(x, ids.int(), wts, gate, w)
    assert torch.isfinite(fast).all() and ref.float().norm() > 0
    assert rel(fast, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_experts_fast_bits_padding_and_graph_replay(tp):
    """Identical bits: two eager runs; a batch of 3 vs the same rows padded to 4 (a graph size); a CUDA-graph
    replay of route + experts vs eager on new inputs."""
    w = real_weights(tp)
    gen = torch.Generator().manual_seed(tp)
    logits = (torch.randn(4, 257, generator=gen) * 2).to("cuda", torch.bfloat16)
    x = torch.randn(4, 2048, generator=gen).to("cuda", torch.bfloat16)

    def step(x, logits):
        ids, wts, gate = moe.route_fast(logits, 8)
        return moe.experts_fast(x, ids, wts, gate, w)

    eager = step(x, logits)
    assert torch.equal(step(x, logits), eager)
    assert torch.equal(step(x[:3], logits[:3]), eager[:3])
    static_x, static_logits = x.clone(), logits.clone()
    step(static_x, static_logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_x, static_logits)
    x2 = torch.randn(4, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits2 = (torch.randn(4, 257, generator=gen) * 2).to("cuda", torch.bfloat16)
    static_x.copy_(x2)
    static_logits.copy_(logits2)
    graph.replay()
    assert torch.equal(out, step(x2, logits2))


@functools.lru_cache(maxsize=None)
def real_router(tp: int) -> torch.Tensor:
    """The fused router | shared gate [257, 2048], bf16, std 0.02 (logits ~ N(0, 0.9^2) for x ~ N(0, 1))."""
    gen = torch.Generator(device="cuda").manual_seed(100 + tp)
    return (torch.randn(257, 2048, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("T", [1, 4, 8])
def test_down_combine_fast_bf16(tp, T):
    """The one-kernel down+combine against its torch oracle and the two-kernel path, on the same act."""
    w = real_weights(tp)
    num_local = w.gate_up.shape[0]
    gen = torch.Generator().manual_seed(T + tp)
    x = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
    ids, wts, gate = make_routing(T, 256, 8, gen, device="cuda", dtype=torch.bfloat16)
    cfg = moe.moe_config(T, num_local, 2048, 512 // tp, 512 // tp, x.device)
    lay = moe.align_torch(ids, w.start, num_local, cfg["BLOCK_M"])
    act = moe.gate_up_fast(x, w, lay, cfg["gate_up"])
    fast = moe.down_combine_fast(act, w, lay.inverse, ids.int(), wts, gate, cfg["down_combine"])
    assert torch.isfinite(fast).all()
    assert rel(fast, moe.down_combine_torch(act, w, lay.inverse, ids, wts, gate)) <= 1e-2
    two = moe.combine_fast(moe.down_fast(act, w, lay, wts, gate, cfg["down"]), lay.inverse, T)
    assert rel(fast, two) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("T", [1, 2, 8, 16, 64])
def test_moe_decode_bf16_real_shapes(tp, T):
    """The decode path on the sorted layout (router GEMM, route_fast, align_fast) with both down+combine choices,
    against experts_torch routed on the same logits."""
    w, router = real_weights(tp), real_router(tp)
    gen = torch.Generator().manual_seed(T * 5 + tp)
    x = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
    ref = moe.experts_torch(x, *moe.route_torch(F.linear(x, router), 8), w)
    for down_combine in (True, False):
        out = moe.decode_path(x, router, 8, w, down_combine, gemv=False)
        assert torch.isfinite(out).all() and rel(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("T", [1, 2, 4, 8, 16, 32])  # 32: TP=8's table takes the GEMV path there
def test_moe_decode_gemv_bf16_real_shapes(tp, T):
    """The GEMV path against experts_torch routed on the same logits, its routing bit for bit route_fast's; the
    same bits on a second eager run and from a CUDA graph replayed on new inputs (every TP's tuned tiles, those that
    sum along K after the loop among them)."""
    w, router = real_weights(tp), real_router(tp)
    gen = torch.Generator().manual_seed(T * 7 + tp)
    x = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits = moe.padded_router_gemm(x, router)
    tile = moe.moe_config(T, w.gate_up.shape[0], 2048, 512 // tp, 512 // tp, x.device)["gemv"]
    g = moe.gate_up_gemv_fast(x, logits, 8, w, tile)
    assert all(torch.equal(a, b) for a, b in zip(g[1:4], moe.route_fast(logits, 8)))
    ref = moe.experts_torch(x, *moe.route_torch(logits, 8), w)
    out = moe.decode_path(x, router, 8, w, gemv=True)
    assert torch.isfinite(out).all() and rel(out, ref) <= 1e-2
    assert torch.equal(moe.decode_path(x, router, 8, w, gemv=True), out)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.decode_path(static, router, 8, w, gemv=True)
    for _ in range(2):
        x2 = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
        static.copy_(x2)
        graph.replay()
        assert torch.equal(replayed, moe.decode_path(x2, router, 8, w, gemv=True))


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 4, 8])
@pytest.mark.parametrize("T", [4, 16, 32, 64])
def test_moe_decode_scan_bf16_real_shapes(tp, T):
    """The scan path, with either down step, against experts_torch routed on the same logits; the same bits on a
    second eager run and from a CUDA graph replayed on new inputs."""
    w, router = real_weights(tp), real_router(tp)
    gen = torch.Generator().manual_seed(T * 3 + tp)
    x = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
    ref = moe.experts_torch(x, *moe.route_torch(moe.padded_router_gemm(x, router), 8), w)
    for down_combine in (True, False):
        run = functools.partial(moe.decode_path, router=router, top_k=8, w=w, down_combine=down_combine,
                                gemv=False, scan=True)
        out = run(x)
        assert torch.isfinite(out).all() and rel(out, ref) <= 1e-2
        assert torch.equal(run(x), out)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = run(static)
        x2 = torch.randn(T, 2048, generator=gen).to("cuda", torch.bfloat16)
        static.copy_(x2)
        graph.replay()
        assert torch.equal(replayed, run(x2))


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_moe_fast_bits_padding_and_graph_replay(tp):
    """Identical bits on the decode path (the GEMV path, or router GEMM, route_fast, align_fast), for graph sizes
    with and without the one-kernel down+combine: two eager runs; CUDA-graph replays (new inputs each time) vs
    eager."""
    w, router = real_weights(tp), real_router(tp)
    gen = torch.Generator().manual_seed(tp)
    for b in (1, 4, 16, 56):
        x = torch.randn(b, 2048, generator=gen).to("cuda", torch.bfloat16)
        eager = moe.moe_fast(x, router, 8, w)
        assert torch.equal(moe.moe_fast(x, router, 8, w), eager)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.moe_fast(static, router, 8, w)
        for _ in range(3):
            x2 = torch.randn(b, 2048, generator=gen).to("cuda", torch.bfloat16)
            static.copy_(x2)
            graph.replay()
            assert torch.equal(out, moe.moe_fast(x2, router, 8, w))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I", [(1, 2048, 64), (64, 2048, 512), (300, 4096, 1536)])
def test_mlp_fast_bf16(T, H, I):
    gen = torch.Generator().manual_seed(T)
    gate_up = (torch.randn(2 * I, H, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    down = (torch.randn(H, I, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    assert rel(mlp_fast(x, gate_up, down), mlp_torch(x, gate_up, down)) <= 1e-2
