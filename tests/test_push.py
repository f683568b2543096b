"""The layer boundary by push and pull (dist/push.py; its consumers in layers/norm.py and layers/linear.py).

CPU, through Triton's interpreter, fp32, P simulated inboxes in one process (each rank's kernels run in turn, every
producer before the consumers) and P processes sharing memory (every wait a real cross-process handshake):
- push_ then the pull + add + norm kernel equals add_rms_norm_torch(rank-order sum, residual) (residual exact,
  output within 1e-5), the same bits on every rank; two boundaries a forward, two forwards, and every inbox
  empty after each (the producers and end_step empty what was read);
- the GEMV pushing from its epilogue (a row-parallel projection) then consume: the rank-order sum of every rank's
  GEMV output, exact; the MoE's combine likewise;
- the GEMV pulling in its prologue (RMSNorm.boundary of a Pushed): its output equals F.linear of the pulled, added
  and normed rows, and it stores that sum and those rows for the layer's other readers; the dense MLP's gated
  gate_up GEMV likewise, its silu(gate) * up the bits of silu_mul_fast over the plain GEMV;
- shapes the inbox does not take (more rows, another width or dtype) are not pushed; a forward with more
  boundaries than the inbox has slots is an error.
GPU: the same kernels compiled on one GPU (simulated inboxes, bf16) and across 2 GPUs through symmetric memory,
eager and inside a CUDA graph replayed over changing data.
"""
import pytest
import torch
import torch.multiprocessing as mp

from benchmarks.bench_allreduce import rank_order_sum
from dist import push
from layers.linear import linear_fast
from layers.norm import RMSNorm, add_rms_norm_torch, pull_add_rms_norm, rms_norm_torch
from tests.compare import max_diff

EPS = 1e-6


def inboxes(world, slots, rows, hidden, dtype=torch.float32, device="cpu", share=False):
    nbytes = push.inbox_bytes(slots, world, rows, hidden, dtype)
    bufs = [push.empty_inbox_(torch.empty(nbytes, dtype=torch.uint8, device=device)) for _ in range(world)]
    if share:
        bufs = [b.share_memory_() for b in bufs]
    return bufs, [push.Inbox([b.data_ptr() for b in bufs], r, slots, rows, hidden, dtype, torch.device(device),
                             keep=bufs) for r in range(world)]


def all_empty(buf) -> bool:
    return bool((buf == 255).all())


def parts_of(world, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(world)]


def push_from_every_rank(boxes, produce):
    """A new forward on every simulated rank, then produce(r) run with rank r's inbox installed, for every r in turn
    (one process plays all the ranks): the producers' Pushed, in rank order."""
    for b in boxes:
        push.begin_step(b)
    pushed = []
    for r in range(len(boxes)):
        push.install(boxes[r])
        try:
            pushed.append(produce(r))
        finally:
            push.install(None)
    return pushed


def test_the_runners_inbox_takes_its_verify_steps_rows():
    """A runner's inbox (qwen35/runner.py push_rows) holds the rows of its verify steps, k + 1 a sequence, so that
    their boundaries push too (up to push.MAX_ROWS: batch 64 at k = 3), and a plain decode step's without
    speculation."""
    from qwen35.runner import push_rows
    assert push_rows(64, 0) == 64 and push_rows(64, 1) == 128 and push_rows(64, 3) == push.MAX_ROWS == 256
    assert push_rows(8, 3) == 32 and push_rows(256, 3) == push.MAX_ROWS
    _, boxes = inboxes(2, 2, push_rows(16, 2), 8)
    assert boxes[0].takes((16 * 3, 8), torch.float32) and not boxes[0].takes((16 * 3 + 1, 8), torch.float32)


@pytest.mark.parametrize("world,rows", [(1, 1), (2, 2), (3, 5), (4, 1), (8, 3)])
def test_push_then_pull_add_norm(world, rows):
    H = 48
    bufs, boxes = inboxes(world, 3, 8, H)
    residual, w = torch.randn(rows, H), torch.randn(H) * 0.2
    for step in (1, 2):  # a forward of two boundaries, twice: each forward leaves every inbox empty
        parts = [p * step for p in parts_of(world, (rows, H), seed=rows)]
        for b in boxes:
            push.begin_step(b)
        pushed = [push.push_(parts[r], boxes[r]) for r in range(world)]
        assert [p.slot for p in pushed] == [0] * world
        y0, s0 = add_rms_norm_torch(rank_order_sum(parts), residual, w, EPS)
        outs = [pull_add_rms_norm(pushed[r], residual, w, EPS) for r in range(world)]
        for y, s in outs:
            assert torch.equal(s, s0)
            assert max_diff(y, y0) <= 1e-5
            assert torch.equal(y, outs[0][0])
        second = [push.push_(-parts[r], boxes[r]) for r in range(world)]  # (empties slot 0 of its own inbox)
        assert all(torch.equal(push.consume(p), -rank_order_sum(parts)) for p in second)
        for b in boxes:
            push.end_step(b)
        assert all(all_empty(buf) for buf in bufs)


@pytest.mark.parametrize("world,rows", [(2, 1), (3, 2), (2, 8), (3, 5)])
def test_gemv_pushes_and_pulls(world, rows):
    """A boundary as the model runs it at decode sizes: every rank's out projection (GEMV) pushes its partial sums,
    every rank's next input projection (GEMV) pulls them in its prologue with the norm folded in (past two rows
    the row grid, a program per column block and row, as the MoE router's)."""
    K, H, N = 24, 40, 16
    bufs, boxes = inboxes(world, 4, max(rows, 2), H)
    gen = torch.Generator().manual_seed(world)
    ys = [torch.randn(rows, K, generator=gen) for _ in range(world)]
    w_out = [torch.randn(H, K, generator=gen) * 0.3 for _ in range(world)]   # row-parallel shards
    w_in = torch.randn(N, H, generator=gen) * 0.3                            # the next projection (replicated)
    residual, norm_w = torch.randn(rows, H, generator=gen), torch.randn(H, generator=gen) * 0.2
    gemv = dict(gemv_rows=16, rows_in_grid=rows > 2)
    pushed = push_from_every_rank(boxes, lambda r: linear_fast(ys[r], w_out[r], partial=True, **gemv))
    unpushed = [linear_fast(y, w, partial=True, **gemv) for y, w in zip(ys, w_out)]  # no inbox: the GEMV's output
    assert max_diff(unpushed[0], torch.nn.functional.linear(ys[0], w_out[0])) <= 1e-5
    total = rank_order_sum(unpushed)
    for r in range(world):
        assert isinstance(pushed[r], push.Pushed) and pushed[r].slot == 0 and pushed[r].shape == (rows, H)
        assert torch.equal(push.consume(pushed[r]), total)  # the same GEMV's rows, summed in rank order
    s0 = total + residual
    h0 = rms_norm_torch(s0, norm_w, EPS)
    norm = RMSNorm(H, EPS)
    norm.weight.data.copy_(norm_w)
    norm._fast = True  # (built under the torch kernel set: choose the fold as the fast set does)
    for r in range(world):
        pending, res = norm.boundary(pushed[r], residual)
        assert not isinstance(pending, torch.Tensor)  # folded into the GEMV below
        y = linear_fast(pending, w_in, **gemv)
        assert pending.done and torch.equal(res, s0)
        assert max_diff(pending.out, h0) <= 1e-5
        assert max_diff(y, torch.nn.functional.linear(h0, w_in)) <= 1e-4
    assert not any(all_empty(buf) for buf in bufs)


@pytest.mark.parametrize("world,rows", [(2, 1), (3, 2)])
def test_gated_gemv_pulls(world, rows):
    """A dense MLP's gate_up reading the boundary before it (the post-attention norm of pushed partial sums): the
    gated GEMV pulls, adds and norms in its prologue and gives silu(gate) * up, the bits of silu_mul_fast over the
    plain GEMV of the normed rows it stores."""
    from layers.activation import silu_mul_fast
    H, I = 40, 21
    bufs, boxes = inboxes(world, 2, 2, H)
    parts = parts_of(world, (rows, H), seed=rows)
    gen = torch.Generator().manual_seed(world)
    gate_up, residual = torch.randn(2 * I, H, generator=gen) * 0.3, torch.randn(rows, H, generator=gen)
    norm = RMSNorm(H, EPS)
    norm.weight.data.copy_(torch.randn(H, generator=gen) * 0.2)
    norm._fast = True  # (built under the torch kernel set: choose the fold as the fast set does)
    pushed = push_from_every_rank(boxes, lambda r: push.push_(parts[r], boxes[r]))
    s0 = rank_order_sum(parts) + residual
    for r in range(world):
        pending, res = norm.boundary(pushed[r], residual)
        y = linear_fast(pending, gate_up, gated=True)
        assert pending.done and torch.equal(res, s0)
        assert max_diff(pending.out, rms_norm_torch(s0, norm.weight, EPS)) <= 1e-5
        assert torch.equal(y, silu_mul_fast(linear_fast(pending.out, gate_up)))


@pytest.mark.parametrize("world,rows", [(2, 3), (3, 8), (2, 16), (2, 24), (3, 32)])
def test_rows_kernel_pushes(world, rows, monkeypatch):
    """Past the GEMV's rows the out projection runs the rows kernel (layers/linear.py rows_gemm), which pushes from
    its epilogue (up to ROWS_PUSH_MAX_M rows: past ROWS_MAX_M only pushing): every rank's consume is the rank-order
    sum of the same kernel's unpushed outputs, exactly; as the first boundary of a forward its slot is emptied by
    the next producer (push_), as the second it empties the first's, and end_step its own."""
    from layers import linear as lin
    assert rows <= lin.ROWS_PUSH_MAX_M
    if rows > lin.ROWS_MAX_M:  # (unpushed, those rows take F.linear: the reference is the rows kernel's own sums)
        monkeypatch.setattr(lin, "ROWS_MAX_M", rows)
    K, H = 24, 40
    bufs, boxes = inboxes(world, 4, rows, H)
    gen = torch.Generator().manual_seed(rows)
    ys = [torch.randn(rows, K, generator=gen) for _ in range(world)]
    w_out = [torch.randn(H, K, generator=gen) * 0.3 for _ in range(world)]
    unpushed = [linear_fast(y, w, partial=True) for y, w in zip(ys, w_out)]
    assert max_diff(unpushed[0], torch.nn.functional.linear(ys[0], w_out[0])) <= 1e-5
    total = rank_order_sum(unpushed)
    for first in (True, False):
        before = [] if first else push_from_every_rank(boxes, lambda r: push.push_(torch.ones(rows, H)))
        assert all(torch.equal(push.consume(p), torch.full((rows, H), float(world))) for p in before)
        for r in range(world):
            push.install(boxes[r])
            try:
                pushed = linear_fast(ys[r], w_out[r], partial=True)
            finally:
                push.install(None)
            assert isinstance(pushed, push.Pushed) and pushed.slot == (0 if first else 1)
            assert pushed.shape == (rows, H)
        for r in range(world):
            assert torch.equal(push.consume(push.Pushed(boxes[r], pushed.slot, pushed.shape, pushed.dtype)), total)
        if first:
            nxt = [push.push_(torch.zeros(rows, H), boxes[r]) for r in range(world)]  # (empties slot 0)
            assert all(torch.equal(push.consume(p), torch.zeros(rows, H)) for p in nxt)
        for b in boxes:
            push.end_step(b)
        assert all(all_empty(buf) for buf in bufs)


def ends_a_forward_of_two(bufs, boxes, pushed, total):
    """Every rank's first boundary (pushed, slot 0) sums to `total` exactly; a second boundary of zeros, pushed by
    push_, empties the first, and end_step the second: every inbox is empty after."""
    T, H = total.shape
    for r, box in enumerate(boxes):
        assert isinstance(pushed[r], push.Pushed) and pushed[r].slot == 0
        assert torch.equal(push.consume(pushed[r]), total)
    second = [push.push_(torch.zeros(T, H), box) for box in boxes]
    assert all(torch.equal(push.consume(p), torch.zeros(T, H)) for p in second)
    for b in boxes:
        push.end_step(b)
    assert all(all_empty(buf) for buf in bufs)


@pytest.mark.parametrize("world,T", [(2, 1), (3, 5)])
def test_moe_combine_pushes(world, T):
    """The MoE's combine (layers/moe/grouped.py) pushing from its epilogue: every rank's combined rows go to every
    inbox, and the boundary's sum is the rank-order sum of each rank's combine_torch output, exact; the second
    boundary's producer empties the first."""
    from layers.moe.grouped import combine_fast, combine_torch
    H, k = 40, 3
    bufs, boxes = inboxes(world, 3, 8, H)
    gen = torch.Generator().manual_seed(world * 10 + T)
    ys = [torch.randn(T * (k + 1), H, generator=gen) for _ in range(world)]
    inverse = (T + torch.arange(T * k)).int()
    inverse[1] = -1  # another rank's expert: adds nothing
    pushed = push_from_every_rank(boxes, lambda r: combine_fast(ys[r], inverse, T, partial=True))
    total = rank_order_sum([combine_torch(y, inverse, T) for y in ys])
    ends_a_forward_of_two(bufs, boxes, pushed, total)


def test_moe_past_the_decode_kernels_pushes():
    """The MoE block at more tokens than its decode kernels take (layers/moe/block.py moe_fast: the grouped path, as
    a verify step of batch 64 x (k + 1) rows runs it) pushes its partial sums too, from the combine's epilogue:
    every rank's boundary sum is the rank-order sum of each rank's unpushed output, exact (fp32). Before, it
    returned them for an all-reduce, and the MTP head's forward of such rows pushed one boundary only."""
    from layers.moe import block as moe_block
    from layers.moe.tiles import DECODE_MAX_T
    from tests.test_kernels_moe import make_weights
    world, T, H = 2, DECODE_MAX_T + 1, 32
    bufs, boxes = inboxes(world, 3, T, H)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(5, H, generator=gen) * 0.3  # 4 experts and the shared gate
    ws = [make_weights(2, H, 16, 8, 2 * r, gen) for r in range(world)]  # rank r: experts 2r, 2r + 1
    pushed = push_from_every_rank(boxes, lambda r: moe_block.moe_fast(x, router, 2, ws[r], partial=True))
    total = rank_order_sum([moe_block.moe_fast(x, router, 2, w) for w in ws])
    ends_a_forward_of_two(bufs, boxes, pushed, total)


def test_rows_kernel_row_limits():
    """rows_gemm takes up to ROWS_MAX_M rows, up to ROWS_PUSH_MAX_M where it pushes, and names the limit past them;
    linear_fast pushes through it up to ROWS_PUSH_MAX_M rows (the rank-order sum of its rows, within fp32 tolerance
    of F.linear), and past them pushes F.linear's bits (push_)."""
    from layers import linear as lin
    M = lin.ROWS_PUSH_MAX_M
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(M + 1, 8, generator=gen), torch.randn(32, 8, generator=gen)
    with pytest.raises(ValueError, match=f"1..{lin.ROWS_MAX_M} rows \\(not pushed\\)"):
        lin.rows_gemm(x[:lin.ROWS_MAX_M + 1], w)
    pushed = []
    for rows in (M, M + 1):  # (a forward's boundaries all have one row count: an inbox each)
        box = inboxes(1, 2, M + 1, 32)[1][0]
        push.install(box)
        try:
            push.begin_step()
            if rows > M:
                with pytest.raises(ValueError, match=f"1..{M} rows \\(pushed\\)"):
                    lin.rows_gemm(x[:rows], w, box=box)
            pushed.append(linear_fast(x[:rows], w, partial=True))
        finally:
            push.install(None)
    assert all(isinstance(p, push.Pushed) for p in pushed)
    assert max_diff(push.consume(pushed[0]), torch.nn.functional.linear(x[:M], w)) <= 1e-5
    assert torch.equal(push.consume(pushed[1]), torch.nn.functional.linear(x, w))


def test_what_the_inbox_does_not_take():
    _, boxes = inboxes(2, 1, 4, 32)
    box = boxes[0]
    assert box.takes((4, 32), torch.float32) and box.takes((1, 1, 32), torch.float32)
    assert not box.takes((5, 32), torch.float32)     # more rows than a region holds: the one-shot path
    assert not box.takes((2, 16), torch.float32)     # another width
    assert not box.takes((2, 32), torch.bfloat16)    # another dtype
    assert not box.takes((0, 32), torch.float32)
    push.install(box)
    try:
        assert not isinstance(linear_fast(torch.randn(5, 8), torch.randn(32, 8), partial=True), push.Pushed)
        assert isinstance(linear_fast(torch.randn(1, 8), torch.randn(32, 8), partial=True), push.Pushed)
        with pytest.raises(RuntimeError, match="1 boundaries"):
            linear_fast(torch.randn(1, 8), torch.randn(32, 8), partial=True)
        with pytest.raises(RuntimeError, match="at least 2"):
            push.end_step()
        with pytest.raises(RuntimeError, match="did not end_step"):
            push.begin_step()
    finally:
        push.install(None)
    with pytest.raises(ValueError, match="does not fit"):
        push.push_(torch.randn(5, 32), box)
    box = inboxes(2, 2, 4, 32)[1][0]
    push.begin_step(box)
    push.push_(torch.randn(2, 32), box)
    with pytest.raises(RuntimeError, match="of 2 and of 3 rows"):  # a slot is emptied by its forward's rows
        push.push_(torch.randn(3, 32), box)


def _processes_worker(rank, world, bufs, parts, residual, w, out):
    torch.set_num_threads(1)
    box = push.Inbox([b.data_ptr() for b in bufs], rank, 2, 4, parts[0].shape[-1], torch.float32,
                     torch.device("cpu"), keep=bufs)
    for it in range(3):  # later rounds store into slots every rank has read in the round before
        push.begin_step(box)
        a = push.push_(parts[rank] * (it + 1), box)
        y, s = pull_add_rms_norm(a, residual, w, EPS)
        b = push.push_(parts[rank] * -(it + 2), box)
        out[it, 0, rank] = push.consume(b)
        out[it, 1, rank], out[it, 2, rank] = y, s
        push.end_step(box)


@pytest.mark.parametrize("world", [2, 3])
def test_push_pull_across_processes(world):
    """Each rank a process, the inboxes shared memory mapped at different addresses in each (as symmetric memory
    is), every poll a real cross-process wait; two boundaries per round, three rounds; every inbox empty at the
    end."""
    rows, n = 3, 40
    parts = [p.share_memory_() for p in parts_of(world, (rows, n), seed=world)]
    residual, w = torch.randn(rows, n), torch.randn(n) * 0.2
    out = torch.zeros(3, 3, world, rows, n).share_memory_()
    bufs, _ = inboxes(world, 2, 4, n, share=True)
    mp.start_processes(_processes_worker, args=(world, bufs, parts, residual, w, out), nprocs=world, join=True,
                       start_method="spawn")
    for it in range(3):
        y0, s0 = add_rms_norm_torch(rank_order_sum([p * (it + 1) for p in parts]), residual, w, EPS)
        minus = rank_order_sum([p * -(it + 2) for p in parts])
        for rank in range(world):
            assert torch.equal(out[it, 0, rank], minus)
            assert torch.equal(out[it, 2, rank], s0)
            assert max_diff(out[it, 1, rank], y0) <= 1e-5
            assert torch.equal(out[it, 1, rank], out[it, 1, 0])
    assert all(all_empty(b) for b in bufs)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("world,rows", [(2, 1), (4, 2), (8, 8)])
def test_gpu_push_pull_simulated_inboxes_bf16(world, rows):
    """Compiled kernels, P inboxes on one GPU: the rank-order sum exact, the norm within one bf16 ulp of the
    torch path on the same sum, the GEMV push + pull against F.linear."""
    H, K, N = 2048, 256, 512
    _, boxes = inboxes(world, 3, 8, H, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    ys = [torch.randn(rows, K, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    w_out = [torch.randn(H, K, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(world)]
    residual = torch.randn(rows, H, generator=gen, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.randn(H, generator=gen, device="cuda") .to(torch.bfloat16) * 0.2
    pushed = push_from_every_rank(boxes, lambda r: linear_fast(ys[r], w_out[r], partial=True, gemv_rows=16,
                                                               rows_in_grid=rows > 2))
    partials = [linear_fast(y, w, gemv_rows=16, rows_in_grid=rows > 2) for y, w in zip(ys, w_out)]  # (not pushed)
    total = rank_order_sum([p.float() for p in partials]).to(torch.bfloat16)
    y0, s0 = add_rms_norm_torch(total, residual, norm_w, EPS)
    for r in range(world):
        assert torch.equal(push.consume(pushed[r]), total)
    outs = [pull_add_rms_norm(p, residual, norm_w, EPS) for p in pushed]
    torch.cuda.synchronize()
    for y, s in outs:
        assert torch.equal(s, s0)
        assert torch.equal(y, outs[0][0])
        assert max_diff(y.float(), y0.float()) <= 2 ** -7 * y0.float().abs().max().item() + 1e-3


# ---------------------------------------------------------------------------------------------- the model
def _model_worker(rank, world, port, path, plans, ws_bufs, ws_bytes, box_bufs, out_file):
    import os

    from dist import allreduce, parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from tests.test_model import make_runner
    parallel.init_distributed("cpu")
    torch.set_num_threads(1)
    allreduce.install(allreduce.Workspace([b.data_ptr() for b in ws_bufs], rank, ws_bytes, torch.device("cpu"),
                                          keep=ws_bufs))
    runner = make_runner(path, kernels="fast")
    cfg = runner.config
    push.install(push.Inbox([b.data_ptr() for b in box_bufs], rank, 2 * cfg.num_hidden_layers, 2, cfg.hidden_size,
                            torch.float32, torch.device("cpu"), keep=box_bufs))
    claims = []
    claim = push.Inbox.claim
    push.Inbox.claim = lambda self, rows: claims.append(1) or claim(self, rows)
    results = []
    for p in plans:
        before = len(claims)
        results.append(runner.execute(p))
        claims.append(("step", len(claims) - before))
    if rank == 0:
        torch.save((results, [c[1] for c in claims if isinstance(c, tuple)]), out_file)
    parallel.destroy()


def test_tensor_parallel_2_push_equals_1(tmp_path):
    """The whole model at TP=2 over gloo, boundaries of the 1- and 2-row decode steps by push and pull, the others
    (prefill, a 3-token step) by the one-shot / two-shot kernels and gloo: equal to TP=1 to 1e-5."""
    from scheduler.plan import StepPlan
    from tests.hf_reference import build_hf_model, free_port
    from tests.test_allreduce import shared_buffers
    from tests.test_model import blocks_for, make_runner
    path = str(tmp_path / "moe")
    build_hf_model("moe").save_pretrained(path)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (20, 9)]
    tables = [blocks_for(0, 22), blocks_for(1, 11)]
    plans = [StepPlan([0, 1], seqs, [0, 0], tables, [True, True]),
             StepPlan([0, 1], [[5], [6]], [20, 9], tables, [True, True]),
             StepPlan([1], [[4]], [10], [tables[1]], [True]),
             StepPlan([1, 0], [[8, 9], [7]], [11, 21], [tables[1], tables[0]], [True, True]),
             StepPlan([0, 1], [[3], [2]], [22, 13], tables, [True, True])]
    runner = make_runner(path, kernels="fast")
    single = [runner.execute(p) for p in plans]
    layers = runner.config.num_hidden_layers
    ws_bytes = 4096
    ws_bufs = shared_buffers(2, ws_bytes, share=True)
    box_bufs, _ = inboxes(2, 2 * layers, 2, runner.config.hidden_size, share=True)
    out_file = str(tmp_path / "tp2.pt")
    mp.start_processes(_model_worker, args=(2, free_port(), path, plans, ws_bufs, ws_bytes, box_bufs, out_file),
                       nprocs=2, join=True, start_method="spawn")
    tp2, pushed = torch.load(out_file)
    assert pushed == [0, 2 * layers, 2 * layers, 0, 2 * layers]  # decode steps: every mixer and feed-forward
    for a, b in zip(single, tp2):
        assert a.shape == b.shape
        assert max_diff(a, b) <= 1e-5


def _gpu_worker(rank, world, port, out_file):
    import os

    import torch.distributed as torch_dist

    from dist import parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    parallel.init_distributed("cuda")
    dev = torch.device("cuda", rank)
    H, K, N = 2048, 512, 1024
    assert parallel.setup_symmetric_all_reduce(64 * H * 2, dev)
    assert parallel.setup_push(4, push.MAX_ROWS, H, torch.bfloat16, dev)
    errors = []
    gen = torch.Generator(device="cuda").manual_seed(rank)
    shared = torch.Generator(device="cuda").manual_seed(99)
    w_out = torch.randn(H, K, generator=gen, device="cuda").to(torch.bfloat16) * 0.05   # this rank's shard
    w_in = torch.randn(N, H, generator=shared, device="cuda").to(torch.bfloat16) * 0.05
    norm_w = (torch.randn(H, generator=shared, device="cuda") * 0.2).to(torch.bfloat16)
    from layers.backend import use_kernels
    with use_kernels("fast"):
        norm = RMSNorm(H, EPS, dtype=torch.bfloat16, device="cuda")
    norm.weight.data.copy_(norm_w)

    def gathered_sum(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        torch_dist.all_gather(parts, x.contiguous())
        return rank_order_sum([p.float() for p in parts]).to(x.dtype)

    def step(y, residual):
        """Two boundaries as a decode step runs them: GEMV push -> GEMV pull (norm folded); push_ -> pull + norm."""
        push.begin_step()
        p1 = linear_fast(y, w_out, partial=True)
        pending, res1 = norm.boundary(p1, residual)  # (a PendingNorm at <= 2 rows, else computed)
        z = linear_fast(pending, w_in)
        h1 = pending if isinstance(pending, torch.Tensor) else pending.out
        p2 = push.push_(h1)
        h2, res2 = norm.all_reduce_add(p2, res1)
        push.end_step()
        return z, h1, res1, h2, res2

    def check(tag, y, residual, got):
        z, h1, res1, h2, res2 = got
        unpushed = linear_fast(y, w_out)
        s1 = gathered_sum(unpushed)
        want_h1, want_res1 = add_rms_norm_torch(s1, residual, norm_w, EPS)
        if not torch.equal(res1, want_res1) or max_diff(h1, want_h1) > 0.02:
            errors.append(f"{tag}: boundary 1 residual {max_diff(res1, want_res1)}, norm {max_diff(h1, want_h1)}")
        # the pulling GEMV against the plain GEMV on the rows it stored: at one row the folded GEMV runs wider
        # programs (GEMV_CONFIG norm_tile_1), whose fp32 sums go in another order, so its bf16 outputs may differ
        # by an ulp (|z| ~ 0.5 here: 0.004); rows pulled from a stale or half-written inbox differ by ~|z|
        d = max_diff(z, linear_fast(h1, w_in))
        if d > 0.01:
            errors.append(f"{tag}: the pulling GEMV differs from the GEMV on its own stored rows by {d}")
        want_h2, want_res2 = add_rms_norm_torch(gathered_sum(h1), res1, norm_w, EPS)
        if not torch.equal(res2, want_res2) or max_diff(h2, want_h2) > 0.02:
            errors.append(f"{tag}: boundary 2 residual {max_diff(res2, want_res2)}, norm {max_diff(h2, want_h2)}")
        for t in (z, h2):
            parts = [torch.empty_like(t) for _ in range(world)]
            torch_dist.all_gather(parts, t)
            if not all(torch.equal(p, parts[0]) for p in parts):
                errors.append(f"{tag}: ranks differ")

    for rows in (1, 2, 8, 32, 64, 256, 2, 1):  # (after 256 rows, fewer: a forward empties the rows it filled)
        y = torch.randn(rows, K, generator=gen, device="cuda").to(torch.bfloat16)
        residual = torch.randn(rows, H, generator=shared, device="cuda").to(torch.bfloat16)
        check(f"eager {rows} rows", y, residual, step(y, residual))
    rows = 1
    y = torch.randn(rows, K, generator=gen, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, H, generator=shared, device="cuda").to(torch.bfloat16)
    step(y, residual)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(y, residual)
    for i in range(4):
        y.copy_(torch.randn(rows, K, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        check(f"graph replay {i}", y, residual, out)
    if rank == 0:
        torch.save(errors, out_file)
    parallel.destroy()


@pytest.mark.gpu
@pytest.mark.timeout(600, method="thread")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (symmetric memory between devices)")
def test_gpu_push_pull_two_ranks(tmp_path):
    """Two GPUs, real symmetric memory: a GEMV pushing and a GEMV pulling with the norm folded in, push_ and the pull
    + norm kernel; eager at 1, 2, 8, 32, 64 and 256 rows (then fewer again) and replayed from a CUDA graph over new
    data; identical on both ranks."""
    from tests.hf_reference import free_port
    out_file = str(tmp_path / "errors.pt")
    mp.start_processes(_gpu_worker, args=(2, free_port(), out_file), nprocs=2, join=True, start_method="spawn")
    assert torch.load(out_file) == []


def test_push_pull_kernels_compile_for_hopper():
    """Every push / pull kernel variant of a decode boundary, as the tests above launch them (GEMV pushing and
    pulling, down + combine pushing, the MoE's combine pushing, push_, the pull + norm kernel, consume, end_step),
    and the MoE scan path's kernels before it, compile for sm_90 through Triton's compiler in bf16 (the interpreter
    accepts code the compiler does not)."""
    from layers.backend import use_kernels
    from layers.moe.experts import ExpertWeights
    from layers.moe.gemv import down_combine_fast
    from layers.moe.grouped import combine_fast
    from layers.moe.scan import down_scan_fast, gate_up_scan_fast
    from tests.hopper_compile import compile_all, hopper_backend_available, recorded
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    H, K, world, dt = 64, 32, 2, torch.bfloat16
    _, boxes = inboxes(world, 4, 2, H, dt)
    with recorded() as launches, use_kernels("fast"):
        box = boxes[0]
        push.install(box)
        try:
            push.begin_step()
            p1 = linear_fast(torch.randn(1, K, dtype=dt), torch.randn(H, K, dtype=dt), partial=True)
            norm = RMSNorm(H, EPS, dtype=dt)
            pending, res = norm.boundary(p1, torch.randn(1, H, dtype=dt))
            # (the peer's rows: this one process plays rank 1 too)
            push.install(boxes[1])
            boxes[1].next_slot = 0
            linear_fast(torch.randn(1, K, dtype=dt), torch.randn(H, K, dtype=dt), partial=True)
            push.install(box)
            linear_fast(pending, torch.randn(16, H, dtype=dt))
            E, I = 4, 16
            w = ExpertWeights(torch.randn(E, 2 * I, H, dtype=dt), torch.randn(E, H, I, dtype=dt), 0,
                              torch.randn(2 * I, H, dtype=dt), torch.randn(H, I, dtype=dt))
            ids = torch.tensor([[0, 1]], dtype=torch.int32)
            down_combine_fast(torch.randn(3, I, dtype=dt), w, torch.tensor([1, 2], dtype=torch.int32), ids,
                              torch.rand(1, 2, dtype=dt), torch.rand(1, 1, dtype=dt), partial=True)
            g = gate_up_scan_fast(torch.randn(1, H, dtype=dt), ids, torch.rand(1, 2, dtype=dt),
                                  torch.rand(1, 1, dtype=dt), w)
            y = down_scan_fast(g.act, w, g.inverse, ids, g.weights, g.shared_gate)
            combine_fast(y, g.inverse, 1, partial=True)
            p3 = push.push_(torch.randn(1, H, dtype=dt))
            boxes[1].next_slot = 3
            push.install(boxes[1])
            push.push_(torch.randn(1, H, dtype=dt))
            push.install(box)
            pull_add_rms_norm(p3, torch.randn(1, H, dtype=dt), norm.weight, EPS)
            push.consume(p3)
            push.end_step()
        finally:
            push.install(None)
    names = {e["name"] for e in launches}
    assert {"_gemv_kernel", "_down_combine_kernel", "_push_kernel", "_pull_add_rms_norm_kernel",
            "_consume_kernel", "_clear_kernel", "_gate_up_scan_kernel", "_down_scan_kernel", "_combine_kernel"} <= names, \
        names
    assert compile_all(launches) == []


def test_rows_kernel_compiles_for_hopper():
    """The rows kernel (layers/linear.py rows_gemm) as linear_fast launches it at 3-16 rows, plain with a bias and
    pushing a boundary's partial sums (and emptying the slot before), and at ROWS_PUSH_MAX_M rows pushing, compiles
    for sm_90 in bf16, and so does every tile of ROWS_TILES at those rows, each within Hopper's 227 KB of shared
    memory."""
    from layers import linear as lin
    from layers.backend import use_kernels
    from tests.hopper_compile import compile_all, hopper_backend_available, recorded, variant
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    H, K, world, dt = 64, 1024, 2, torch.bfloat16
    with recorded() as launches, use_kernels("fast"):
        linear_fast(torch.randn(5, K, dtype=dt), torch.randn(H, K, dtype=dt), torch.randn(H, dtype=dt))
        for rows in (8, lin.ROWS_PUSH_MAX_M):
            box = inboxes(world, 4, rows, H, dt)[1][0]
            push.install(box)
            try:
                push.begin_step()
                push.push_(torch.randn(rows, H, dtype=dt))
                linear_fast(torch.randn(rows, K, dtype=dt), torch.randn(H, K, dtype=dt), partial=True)  # (slot 1)
            finally:
                push.install(None)
    rows = [e for e in launches if e["name"] == "_rows_kernel"]
    M = 1 << (lin.ROWS_PUSH_MAX_M - 1).bit_length()  # (the kernel's row tile: the next power of two)
    assert len(rows) == 3 and [r["constexprs"]["BLOCK_M"] for r in rows] == [16, 16, M]
    for launch, M in ((rows[1], 16), (rows[2], M)):
        for n, _, _, _ in lin.ROWS_TILES:  # every tile of the table, at the rows it takes them
            block_n, block_k, stages = lin.rows_tile(n or 1 << 20, M)
            launches.append(variant(launch, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages))
            # and within an sm_90 block's shared memory as the GPU's compiler lays it out (stages - 1 buffers of the
            # rows' and the weight's K step: 64 x 512 x 4 stages asked 245,760 bytes at 16 rows on an H200,
            # 2026-11-28; the CPU's compile does not pipeline the same way, so the sum is checked here)
            assert (stages - 1) * (M + block_n) * block_k * 2 <= 232448
    assert compile_all(launches) == []
