"""MoE routing: the router GEMM and the routing on its logits.

    router_logits_torch / _fast  x @ router^T: logits [T, E + 1] (router | shared gate) in the model dtype
    route_torch / route_fast     softmax (fp32) over the logits, top-k, renormalised; sigmoid of the shared gate

route_token is the one Triton implementation of the routing: route_fast's kernel and the GEMV path's gate_up kernel
(layers/moe/gemv.py) both call it, so both give the same bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from layers.backend import pdl, prior_done, tl, triton
from layers.linear import SKINNY_MAX_M, computed, linear_fast, skinny_gemm

ROUTER_PAD_ROWS = 8      # cuBLAS runs N = E + 1 = 257 on an unaligned kernel, several times slower than N = 264
ROUTER_GEMV_MAX_T = 2    # router_logits_fast: the GEMV kernel up to this many tokens,
ROUTER_ROWS_MAX_T = 16   # then up to this many its row grid (a program per column block and token)


def route_torch(logits: torch.Tensor, top_k: int):
    """logits [T, E + 1] (router | shared gate) in the model dtype -> ids [T, k] int64, weights [T, k] and
    sigmoid(shared gate) [T, 1] in the model dtype.

    Ties go to the lowest expert id (a stable sort): torch.topk leaves the order of equal values unspecified, and
    on the CPU it does not pick the lowest ids."""
    probs = torch.softmax(logits[:, :-1], dim=-1, dtype=torch.float32)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype), torch.sigmoid(logits[:, -1:])


def route_fast(logits: torch.Tensor, top_k: int):
    """route_torch in one Triton kernel (one program per token); ids are int32."""
    T, num_experts = logits.shape[0], logits.shape[1] - 1
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    shared_gate = torch.empty(T, 1, dtype=logits.dtype, device=logits.device)
    if T:
        block = triton.next_power_of_2(num_experts)
        _route_kernel[(T,)](logits, ids, weights, shared_gate, num_experts, logits.stride(0), TOP_K=top_k,
                            K_POW2=triton.next_power_of_2(top_k), BLOCK_E=block, num_warps=max(1, min(4, block // 128)),
                            **pdl())
    return ids, weights, shared_gate


def router_logits_torch(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """The oracle's router GEMM: logits [T, E + 1] (router | shared gate), rounded to the model dtype."""
    return F.linear(x, router)


def router_logits_fast(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """router_logits_torch by T: the GEMV kernel (layers/linear.py) up to ROUTER_GEMV_MAX_T tokens, its row grid (a
    program per column block and token) up to ROUTER_ROWS_MAX_T, the skinny GEMM up to SKINNY_MAX_M, where cuBLAS has
    one poor tile for the 257-wide output (padded_router_gemm above). Up to ROUTER_ROWS_MAX_T a layer boundary's pull
    and norm fold into the router's launch (one launch less than the norm kernel + the skinny GEMM); the row grid
    pays the norm once per row and program where the tiled GEMV pays every row: full model, 1x H200, 2026-11-28,
    against the tiled GEMV to 4 tokens and the skinny GEMM after, a step 3.15 / 4.31 / 6.19 ms at batch 2 / 4 / 8
    against 3.16 / 4.38 / 6.31 (benchmarks/results/2026-11-28_record_h200_tp1_router_grid.json).
    The logits differ from cuBLAS's by the order of the fp32 sums only; a choice by T alone, so a padded graph batch
    takes the same path as the batch run eagerly."""
    T = x.shape[0]
    if T <= ROUTER_GEMV_MAX_T:
        return linear_fast(x, router, gemv_rows=ROUTER_GEMV_MAX_T)  # (computes a PendingNorm x in its prologue)
    if T <= ROUTER_ROWS_MAX_T:  # (likewise, a row a program: the pull and the norm in the router's launch)
        return linear_fast(x, router, gemv_rows=ROUTER_ROWS_MAX_T, rows_in_grid=True)
    x = computed(x)
    if T <= SKINNY_MAX_M:
        return skinny_gemm(x, router)
    return padded_router_gemm(x, router)


def padded_router_gemm(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """router_logits_fast's cuBLAS GEMM: F.linear(x, router), logits [T, E + 1]. Where the router is the leading
    rows of a buffer padded to a multiple of ROUTER_PAD_ROWS rows (SparseMoE's, from fuse_rows), the GEMM runs over
    the padded rows and the extra columns are dropped as a view (row stride = padded rows): at N = 257 cuBLAS picked a
    cutlass align1 kernel that took 6.3 of 254 ms at 8 x 1024 prefill (1x H200 profile, 2026-11-24)."""
    rows, H = router.shape
    padded = -(-rows // ROUTER_PAD_ROWS) * ROUTER_PAD_ROWS
    if padded != rows and router.is_contiguous():
        room = router.untyped_storage().nbytes() // router.element_size() - router.storage_offset()
        if room >= padded * H:
            return F.linear(x, router.as_strided((padded, H), (H, 1)))[:, :rows]
    return F.linear(x, router)


if triton is not None:
    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, w_ptr, sg_ptr, E, sl, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                      BLOCK_E: tl.constexpr):
        """One token's routing (route_token)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        route_token(logits_ptr, ids_ptr, w_ptr, sg_ptr, tl.program_id(0).to(tl.int64), E, sl, True, TOP_K, K_POW2,
                    BLOCK_E)

    @triton.jit
    def route_token(logits_ptr, ids_ptr, w_ptr, sg_ptr, t, E, sl, store, TOP_K: tl.constexpr,
                    K_POW2: tl.constexpr, BLOCK_E: tl.constexpr):
        """route_torch for token t (its logits row sl apart), the one implementation of route_fast's and of the GEMV
        path's routing: softmax in fp32, top-k on int64 keys (the probability's bits, then the column reversed: one
        max per slot takes the largest probability, among ties the lowest id), renormalised, rounded to the model
        dtype; sigmoid of the shared gate's logit (column E). Sums by _exact_sum, so every kernel that calls this
        gives the same bits whatever its warps. Stored where `store`; returns the ids [K_POW2] (slots past TOP_K:
        0)."""
        cols = tl.arange(0, BLOCK_E)
        row = logits_ptr + t * sl
        logit = tl.load(row + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
        num = tl.exp(logit - tl.max(logit, 0))
        p = num / _exact_sum(num)
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)
        key = tl.where(cols < E, key, -1)  # below every probability's key
        slot = tl.arange(0, K_POW2)
        ids = tl.zeros([K_POW2], dtype=tl.int32)
        vals = tl.zeros([K_POW2], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, 0)
            key = tl.where(key == best, -1, key)
            ids = tl.where(slot == j, (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32), ids)
            vals = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), vals)
        smask = slot < tl.where(store, TOP_K, 0)
        tl.store(ids_ptr + t * TOP_K + slot, ids, mask=smask)
        tl.store(w_ptr + t * TOP_K + slot, (vals / _exact_sum(vals)).to(w_ptr.dtype.element_ty), mask=smask)
        g = tl.load(row + E).to(tl.float32)
        tl.store(sg_ptr + t, tl.sigmoid(g).to(sg_ptr.dtype.element_ty), mask=store)
        return ids

    @triton.jit
    def _exact_sum(v):
        """Sum of a vector of values in [0, 1], in 2^-48 fixed point: integer adds give the same bits in any reduction
        order (a float tl.sum's tree follows the layout, so the kernel's num_warps). The sum stays below 2^63 for
        fewer than 2^15 values; dropping what lies below 2^-48 moves a sum >= 2^-8 by < 2^-24 relative while it
        holds fewer than 2^16 values (softmax denominators are >= 1, top-k sums >= k / E)."""
        return tl.sum((v * 281474976710656.0).to(tl.int64), 0).to(tl.float32) * (1.0 / 281474976710656.0)
else:  # pragma: no cover
    route_token = None
