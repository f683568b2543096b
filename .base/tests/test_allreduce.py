"""The symmetric-memory all-reduce (dist/allreduce.py) and the fused layer boundary (layers/norm.py
all_reduce_add_rms_norm_*).

CPU, through Triton's interpreter, fp32:
- the size-based choice of one-shot / two-shot / the process group's collective;
- the kernels over P simulated peers in one process (P = 1, 2, 3, 4, 8: the peers' flags preset as if they had
  signalled): the fused boundary equals add_rms_norm_torch(sum(parts), residual, w, eps) (residual exact, output
  within 1e-5), the sum bit-identical on every rank, each flag taken or sent exactly once;
- the kernels across P processes sharing memory, each barrier a real cross-process handshake: one-shot, two-shot
  and the fused boundary interleaved over changing data, exact, identical bits on every rank, every flag back to 0;
- the whole model at TP=2 over gloo with a shared-memory workspace (fused decode boundaries, two-shot and gloo
  for the bigger messages) equals TP=1 to 1e-5.
GPU: the same kernels compiled (bf16, one GPU, simulated peers: residual bit-exact, output within one bf16 ulp), and
with 2+ GPUs real symmetric memory against an fp32 reference sum, eager and inside CUDA graphs.
The all-gather through the same buffers (simulated peers, P processes, 2 GPUs eager and in a graph): exact.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from benchmarks.bench_allreduce import rank_order_sum
from dist import allreduce, parallel
from layers.norm import add_rms_norm_torch, fused_all_reduce_add_rms_norm
from tests.compare import max_diff
from tests.hf_reference import build_hf_model, free_port

EPS = 1e-6




def shared_buffers(world: int, data_bytes: int, device="cpu", share=False) -> list[torch.Tensor]:
    bufs = [torch.zeros(allreduce.buffer_bytes(data_bytes, world), dtype=torch.uint8, device=device)
            for _ in range(world)]
    return [b.share_memory_() for b in bufs] if share else bufs


def flags(buf: torch.Tensor, data_bytes: int, world: int) -> torch.Tensor:
    return buf[data_bytes:].view(torch.int32).view(allreduce.NUM_CHANNELS, allreduce.MAX_BLOCKS, world)


def simulated_peers(parts, rank, grid, channels=2):
    """A workspace whose P buffers live in this process, each holding its rank's part already, and whose flags say
    that every other rank has signalled `channels` barriers of blocks < grid: one rank's kernel runs alone."""
    world, device = len(parts), parts[0].device
    data_bytes = -(-parts[0].numel() * parts[0].element_size() // 16) * 16
    bufs = shared_buffers(world, data_bytes, device)
    for b, part in zip(bufs, parts):
        b[: part.numel() * part.element_size()].view(part.dtype).copy_(part.flatten())
    pads = [flags(b, data_bytes, world) for b in bufs]
    pads[rank][:channels, :grid] = 1
    pads[rank][:channels, :grid, rank] = 0  # its own signal comes from its own send
    ws = allreduce.Workspace([b.data_ptr() for b in bufs], rank, data_bytes, device, keep=bufs)
    return ws, pads


def check_flags(pads, rank, grid, channels=2):
    """Every expected signal taken from this rank's pad, and exactly one sent into each peer's pad per barrier."""
    assert int(pads[rank].abs().sum()) == 0
    for p, pad in enumerate(pads):
        if p != rank:
            assert torch.equal(pad[:channels, :grid, rank], torch.ones(channels, grid, dtype=torch.int32))
            assert int(pad.sum()) == channels * grid


# ---------------------------------------------------------------------------------------------- choice
def fake_workspace(world=8, data_bytes=1 << 20, one_shot=256 << 10):
    return allreduce.Workspace([1 << 20] * world, 0, data_bytes, torch.device("cpu"), one_shot_max_bytes=one_shot)


def test_choice_by_size_dtype_and_layout():
    ws = fake_workspace()
    bf16 = dict(dtype=torch.bfloat16)
    assert allreduce.choose(torch.empty(1, 2048, **bf16), ws) == "one_shot"      # decode, batch 1: 4 KB
    assert allreduce.choose(torch.empty(64, 2048, **bf16), ws) == "one_shot"     # decode, batch 64: 256 KB
    assert allreduce.choose(torch.empty(65, 2048, **bf16), ws) == "two_shot"
    assert allreduce.choose(torch.empty(256, 2048, **bf16), ws) == "two_shot"    # 1 MiB: the whole data region
    assert allreduce.choose(torch.empty(257, 2048, **bf16), ws) == "collective"  # prefill: NCCL
    assert allreduce.choose(torch.empty(64, 2048), ws) == "two_shot"             # fp32 counts its bytes
    assert allreduce.choose(torch.empty(4, 2048, **bf16)[:, ::2], ws) == "collective"  # not contiguous
    assert allreduce.choose(torch.zeros(4, dtype=torch.int64), ws) == "collective"
    assert allreduce.choose(torch.empty(4, 2048, **bf16), None) == "collective"   # no workspace: TP=1, gloo
    assert allreduce.choose(torch.empty(4, 2048, **bf16), fake_workspace(world=1)) == "collective"


def test_two_shot_needs_room_for_padded_slices():
    """Two-shot pads each rank's slice to 16 elements: 3 ranks x 16 fp32 = 192 bytes for a 33-element message."""
    ws = fake_workspace(world=3, data_bytes=192, one_shot=0)
    assert allreduce.two_shot_slice(33, 3) == 16
    assert allreduce.choose(torch.empty(48), ws) == "two_shot"
    assert allreduce.two_shot_slice(49, 3) == 32
    assert allreduce.choose(torch.empty(49), ws) == "collective"


def test_setup_falls_back_without_peers():
    """TP=1, the CPU, or QWEN35_ALLREDUCE=nccl: no workspace, every all-reduce is the process group's (a no-op at
    TP=1); a bad value of the variable is an error naming it."""
    assert parallel.tp_size() == 1
    assert parallel.setup_symmetric_all_reduce(1 << 20, torch.device("cpu")) is False
    assert allreduce.current() is None
    x = torch.randn(3, 8)
    assert parallel.all_reduce(x.clone()).equal(x)
    os.environ[allreduce.ENV] = "fast"
    try:
        with pytest.raises(ValueError, match=allreduce.ENV):
            parallel.setup_symmetric_all_reduce(1 << 20, torch.device("cpu"))
    finally:
        del os.environ[allreduce.ENV]


def test_message_larger_than_the_workspace_is_refused():
    parts = parts_of(2, (4, 16))
    ws, _ = simulated_peers(parts, 0, grid=1)  # data region: exactly 4 x 16 fp32
    big = torch.zeros(5, 16)
    for call in (lambda: allreduce.one_shot_(big, ws), lambda: allreduce.two_shot_(big, ws),
                 lambda: fused_all_reduce_add_rms_norm(big, big, torch.zeros(16), EPS, ws)):
        with pytest.raises(ValueError, match="does not fit"):
            call()


def test_workspace_rejects_bad_geometry():
    with pytest.raises(ValueError, match="rank"):
        allreduce.Workspace([16, 32], 2, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of 16"):
        allreduce.Workspace([16, 32], 0, 60, torch.device("cpu"))
    with pytest.raises(ValueError, match="aligned"):
        allreduce.Workspace([16, 40], 0, 64, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- one process
def parts_of(world, shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).to(dtype).to(device) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_fused_boundary_simulated_peers(world):
    rows, n = 3, 48
    parts = parts_of(world, (rows, n), seed=world)
    gen = torch.Generator().manual_seed(100 + world)
    residual, w = torch.randn(rows, n, generator=gen), torch.randn(n, generator=gen) * 0.2
    y0, s0 = add_rms_norm_torch(rank_order_sum(parts), residual, w, EPS)
    outs = []
    for rank in range(world):
        ws, pads = simulated_peers(parts, rank, grid=rows)
        y, s = fused_all_reduce_add_rms_norm(parts[rank], residual, w, EPS, ws)
        assert torch.equal(s, s0)
        assert max_diff(y, y0) <= 1e-5
        check_flags(pads, rank, grid=rows)
        outs.append(y)
    assert all(torch.equal(y, outs[0]) for y in outs)  # identical bits on every rank


def test_fused_boundary_more_rows_than_blocks():
    """Rows beyond MAX_BLOCKS: a block takes rows b, b + 64, ... in both phases."""
    world, rows, n = 2, allreduce.MAX_BLOCKS + 3, 16
    parts = parts_of(world, (rows, n), seed=7)
    residual, w = torch.randn(rows, n), torch.randn(n) * 0.2
    y0, s0 = add_rms_norm_torch(rank_order_sum(parts), residual, w, EPS)
    ws, pads = simulated_peers(parts, 1, grid=allreduce.MAX_BLOCKS)
    y, s = fused_all_reduce_add_rms_norm(parts[1], residual, w, EPS, ws)
    assert torch.equal(s, s0) and max_diff(y, y0) <= 1e-5
    check_flags(pads, 1, grid=allreduce.MAX_BLOCKS)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_one_shot_simulated_peers(world):
    numel = 2 * allreduce.FLAT_BLOCK + 5  # three blocks, the last one partial
    parts = parts_of(world, (numel,), seed=world)
    for rank in range(world):
        ws, pads = simulated_peers(parts, rank, grid=3)
        x = parts[rank].clone()
        allreduce.one_shot_(x, ws)
        assert torch.equal(x, rank_order_sum(parts))
        check_flags(pads, rank, grid=3)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_all_gather_simulated_peers(world, dtype):
    """Every rank's part, stacked in rank order, exact (fp32 candidates, int64 counts)."""
    numel = allreduce.FLAT_BLOCK + 7  # two blocks, the second partial
    parts = [(p * 1000).to(dtype) for p in parts_of(world, (numel,), seed=world)]
    for rank in range(world):
        ws, pads = simulated_peers(parts, rank, grid=2)
        out = torch.full((world, numel), -1, dtype=dtype)
        assert allreduce.all_gather_(parts[rank].clone(), out, ws) == (world > 1)
        if world > 1:
            assert torch.equal(out, torch.stack(parts))
            check_flags(pads, rank, grid=2)


def test_all_gather_leaves_big_or_strided_messages_to_the_process_group():
    ws = fake_workspace(world=2, data_bytes=4096, one_shot=1024)
    assert not allreduce.all_gather_(torch.empty(257), torch.empty(2, 257), ws)          # 1028 bytes > 1024
    assert not allreduce.all_gather_(torch.empty(8, 4).T, torch.empty(2, 4, 8), ws)      # not contiguous
    assert not allreduce.all_gather_(torch.empty(8), torch.empty(2, 8), None)            # no workspace


# ---------------------------------------------------------------------------------------------- P processes
def _processes_worker(rank, world, bufs, data_bytes, parts, residual, w, out, gathered):
    torch.set_num_threads(1)
    ws = allreduce.Workspace([b.data_ptr() for b in bufs], rank, data_bytes, torch.device("cpu"), keep=bufs)
    for it in range(2):  # the second round overwrites buffers that every rank has read in the first
        x = parts[rank] * (it + 1)
        out[it, 0, rank] = allreduce.one_shot_(x.clone(), ws)
        out[it, 1, rank] = allreduce.two_shot_(x.clone(), ws)
        y, s = fused_all_reduce_add_rms_norm(x.clone(), residual, w, EPS, ws)
        out[it, 2, rank], out[it, 3, rank] = y, s
        assert allreduce.all_gather_(x, gathered[it, rank], ws)


@pytest.mark.parametrize("world", [2, 3])
def test_kernels_across_processes(world):
    """Each rank a process, the buffers shared memory mapped at different addresses in each (as symmetric memory
    is), every barrier a real handshake through the flags."""
    rows, n, data_bytes = 5, 40, 4096
    parts = [p.share_memory_() for p in parts_of(world, (rows, n), seed=world)]
    residual, w = torch.randn(rows, n), torch.randn(n) * 0.2
    out = torch.zeros(2, 4, world, rows, n).share_memory_()
    gathered = torch.zeros(2, world, world, rows, n).share_memory_()
    bufs = shared_buffers(world, data_bytes, share=True)
    mp.start_processes(_processes_worker, args=(world, bufs, data_bytes, parts, residual, w, out, gathered),
                       nprocs=world, join=True, start_method="spawn")
    for it in range(2):
        assert all(torch.equal(gathered[it, rank], torch.stack(parts) * (it + 1)) for rank in range(world))
        total = rank_order_sum([p * (it + 1) for p in parts])
        y0, s0 = add_rms_norm_torch(total, residual, w, EPS)
        for rank in range(world):
            assert torch.equal(out[it, 0, rank], total)
            assert torch.equal(out[it, 1, rank], total)
            assert torch.equal(out[it, 3, rank], s0)
            assert max_diff(out[it, 2, rank], y0) <= 1e-5
            assert torch.equal(out[it, 2, rank], out[it, 2, 0])
    assert all(int(flags(b, data_bytes, world).abs().sum()) == 0 for b in bufs)


# ---------------------------------------------------------------------------------------------- the model
def _model_worker(rank, world, port, path, plans, bufs, data_bytes, out_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import layers.norm
    from tests.test_model import make_runner
    parallel.init_distributed("cpu")
    torch.set_num_threads(1)
    # decode steps of 2 rows (512 B): the fused one-shot boundary; 3 rows: two-shot + norm; prefill: gloo
    allreduce.install(allreduce.Workspace([b.data_ptr() for b in bufs], rank, data_bytes, torch.device("cpu"),
                                          one_shot_max_bytes=512, keep=bufs))
    calls = {"fused": 0, "one_shot": 0, "two_shot": 0}

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run
    layers.norm.fused_all_reduce_add_rms_norm = counted("fused", layers.norm.fused_all_reduce_add_rms_norm)
    allreduce.one_shot_ = counted("one_shot", allreduce.one_shot_)
    allreduce.two_shot_ = counted("two_shot", allreduce.two_shot_)
    runner = make_runner(path, kernels="fast")
    results = [runner.execute(p) for p in plans]
    if rank == 0:
        torch.save((results, calls), out_file)
    parallel.destroy()


def test_tensor_parallel_2_symmetric_equals_1(tmp_path):
    from scheduler.plan import StepPlan
    from tests.test_model import blocks_for, make_runner
    path = str(tmp_path / "moe")
    build_hf_model("moe").save_pretrained(path)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (20, 9)]
    tables = [blocks_for(0, 22), blocks_for(1, 11)]
    plans = [StepPlan([0, 1], seqs, [0, 0], tables, [True, True]),
             StepPlan([0, 1], [[5], [6]], [20, 9], tables, [True, True]),
             StepPlan([1, 0], [[8, 9], [7]], [10, 21], [tables[1], tables[0]], [True, True])]
    runner = make_runner(path, kernels="fast")
    single = [runner.execute(p) for p in plans]
    data_bytes = 4096  # the 29-token prefill (7.4 KB) goes to gloo
    bufs = shared_buffers(2, data_bytes, share=True)
    out_file = str(tmp_path / "tp2.pt")
    mp.start_processes(_model_worker, args=(2, free_port(), path, plans, bufs, data_bytes, out_file), nprocs=2,
                       join=True, start_method="spawn")
    tp2, calls = torch.load(out_file)
    layers = 4
    assert calls["fused"] == 2 * layers  # the 2-token decode step: every boundary but the first layer's input norm
    assert calls["one_shot"] == 1        # its embedding
    assert calls["two_shot"] == 2 * layers + 1  # the 3-token step: every boundary and the embedding
    for a, b in zip(single, tp2):
        assert a.shape == b.shape
        assert max_diff(a, b) <= 1e-5


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.timeout(300, method="thread")  # a barrier that never opens spins on the GPU: end the process
@pytest.mark.parametrize("world,rows", [(2, 1), (8, 1), (8, 64), (3, 5)])
def test_gpu_fused_boundary_simulated_peers_bf16(world, rows):
    """Compiled (not interpreted) kernels on one GPU: the peers are buffers of the same device."""
    n = 2048
    parts = parts_of(world, (rows, n), torch.bfloat16, "cuda", seed=rows)
    residual = torch.randn(rows, n).to(torch.bfloat16).cuda()
    w = (torch.randn(n) * 0.2).to(torch.bfloat16).cuda()
    y0, s0 = add_rms_norm_torch(rank_order_sum(parts), residual, w, EPS)
    ws, pads = simulated_peers(parts, world - 1, grid=rows)
    y, s = fused_all_reduce_add_rms_norm(parts[-1], residual, w, EPS, ws)
    torch.cuda.synchronize()
    assert torch.equal(s, s0)
    assert max_diff(y, y0) <= 2 ** -7 * 8
    check_flags([p.cpu() for p in pads], world - 1, grid=rows)
    ws, pads = simulated_peers(parts, 0, grid=min(triton_cdiv(rows * n, allreduce.FLAT_BLOCK), allreduce.MAX_BLOCKS))
    x = parts[0].clone()
    allreduce.one_shot_(x, ws)
    assert torch.equal(x, rank_order_sum(parts))


def triton_cdiv(a, b):
    return -(-a // b)


def _gpu_worker(rank, world, port, out_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as torch_dist
    parallel.init_distributed("cuda")
    assert parallel.setup_symmetric_all_reduce(64 * 2048 * 2, torch.device("cuda", rank))
    ws, errors = allreduce.current(), []
    gen = torch.Generator(device="cuda").manual_seed(rank)
    n = 2048
    w = (torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(99)) * 0.2)
    w = w.to(torch.bfloat16)

    def reference(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        torch_dist.all_gather(parts, x)
        return rank_order_sum(parts)

    def reference_gather(x):
        out = torch.empty(world, *x.shape, dtype=x.dtype, device=x.device)
        torch_dist.all_gather_into_tensor(out, x)
        return out

    def same_on_all_ranks(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        torch_dist.all_gather(parts, t)
        return all(torch.equal(p, parts[0]) for p in parts)

    for rows, method in [(1, "one_shot"), (64, "one_shot"), (256, "two_shot"), (1000, "two_shot")]:
        x = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
        want = reference(x)
        if allreduce.choose(x, ws) != method:
            errors.append(f"{rows} rows: {allreduce.choose(x, ws)}, expected {method}")
        got = parallel.all_reduce(x.clone())
        if not torch.equal(got, want) or not same_on_all_ranks(got):
            errors.append(f"{method} {rows} rows: max diff {max_diff(got, want)}")
    # the fused boundary, eager and replayed from a CUDA graph over new data
    rows = 8
    x = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    residual = residual.to(torch.bfloat16)
    from layers.norm import all_reduce_add_rms_norm_fast
    y, s = all_reduce_add_rms_norm_fast(x, residual, w, EPS)
    y0, s0 = add_rms_norm_torch(reference(x), residual, w, EPS)
    if not torch.equal(s, s0) or max_diff(y, y0) > 2 ** -7 * 8 or not same_on_all_ranks(y):
        errors.append(f"fused eager: residual {max_diff(s, s0)}, output {max_diff(y, y0)}")
    gy, gs = all_reduce_add_rms_norm_fast(x, residual, w, EPS)  # warm-up outside the graph, as the runner does
    parallel.all_reduce(gy.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy, gs = all_reduce_add_rms_norm_fast(x, residual, w, EPS)
        gsum = parallel.all_reduce(gy.clone())  # a one-shot right after the fused kernel, on the same flags
    for step in range(3):
        x.copy_(torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16))
        graph.replay()
        y0, s0 = add_rms_norm_torch(reference(x), residual, w, EPS)
        if not torch.equal(gs, s0) or max_diff(gy, y0) > 2 ** -7 * 8 or not torch.equal(gsum, reference(gy)):
            errors.append(f"graph replay {step}: residual {max_diff(gs, s0)}, output {max_diff(gy, y0)}")
    # the all-gather (vocab-parallel sampling's candidates), eager and replayed from a CUDA graph
    c = torch.randn(64, 4, device="cuda", generator=gen)
    if not torch.equal(parallel.all_gather(c), reference_gather(c)):
        errors.append("all-gather eager")
    parallel.all_gather(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = parallel.all_gather(c)
    for step in range(3):
        c.copy_(torch.randn(64, 4, device="cuda", generator=gen))
        graph.replay()
        if not torch.equal(gathered, reference_gather(c)):
            errors.append(f"all-gather graph replay {step}")
    if rank == 0:
        torch.save(errors, out_file)
    parallel.destroy()


@pytest.mark.gpu
@pytest.mark.timeout(600, method="thread")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (symmetric memory between devices)")
def test_gpu_symmetric_all_reduce_two_ranks(tmp_path):
    out_file = str(tmp_path / "errors.pt")
    mp.start_processes(_gpu_worker, args=(2, free_port(), out_file), nprocs=2, join=True, start_method="spawn")
    assert torch.load(out_file) == []
