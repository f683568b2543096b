"""Vocab-parallel sampling across processes (gloo on the CPU): sample_fast from each rank's vocabulary shard gives
exactly the tokens of sample_torch on the whole rows, on every rank.

- the sampler alone at TP=2 and TP=3 (the Triton shard pass through the interpreter): greedy with ties across
  shards, seeded and unseeded temperature, top-k / top-p with their boundaries inside ties that span shards,
  suppressed ids in every shard, padded vocabularies (padding inside the last shard, a shard of padding only);
- the engine at TP=2 with every step's tokens sampled both ways on every rank (the shard pass's torch twin stands
  in for the kernel there: the real vocabulary is too large for the interpreter; test_sampler holds the two equal).
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from layers.sampler import sample_fast, sample_torch
from qwen35.sampling_params import SamplingParams

from hf_reference import free_port, join_ranks
from test_sampler import make_batch

V = 1536  # padded vocabulary: shards of 768 (TP=2) or 512 (TP=3)


def cases() -> list[tuple[str, torch.Tensor, list[SamplingParams], int, list]]:
    """(name, logits [B, V], row params, num_real_tokens, suppressed (row, id) pairs), the same in every process."""
    g = torch.Generator().manual_seed(0)
    out = []

    def add(name, params, real=V - 20, suppress=(), tie=None, scale=2.0):
        logits = torch.randn(len(params), V, generator=g) * scale
        if tie is not None:  # equal logits over ids that span every shard boundary, at the top
            logits[:, tie] = logits.max() + 1.0
        logits[:, real:] = 99.0  # padding would win everything
        out.append((name, logits, params, real, list(suppress)))

    spanning = list(range(500, 540)) + list(range(760, 780)) + list(range(1020, 1030))  # across 512, 768, 1024
    add("greedy", [SamplingParams()] * 6, tie=spanning)
    add("greedy_suppressed", [SamplingParams()] * 4, tie=spanning,
        suppress=[(r, t) for r in range(4) for t in spanning[:r * 20]])  # the tie's lowest ids, more each row
    add("temperature", [SamplingParams(temperature=t, seed=s) for t in (0.5, 1.0, 2.0) for s in (None, 7)]
        + [SamplingParams()])
    add("top_k_tie", [SamplingParams(temperature=1.0, top_k=k) for k in (1, 5, 33, 45, 69, 70, 71)] * 2,
        tie=spanning, scale=0.5)
    add("top_k", [SamplingParams(temperature=1.0, top_k=k, seed=k) for k in (2, 40, 600, 900, 1600, 2**40)])
    add("top_p_tie", [SamplingParams(temperature=1.0, top_p=p) for p in (0.05, 0.3, 0.51, 0.75, 0.99)] * 2,
        tie=spanning, scale=1.0)
    add("top_p", [SamplingParams(temperature=t, top_p=p) for t in (0.7, 1.5) for p in (0.1, 0.8, 0.999)],
        scale=4.0)
    add("both", [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in ((3, 0.4), (50, 0.9), (200, 0.5),
                                                                                 (0, 0.6), (7, 1.0))] * 2,
        tie=spanning[::3], suppress=[(1, 500), (3, 503), (5, 1029), (6, 767), (6, 768), (9, V + 7)])
    add("padding_in_last_shard", [SamplingParams(temperature=1.0, top_p=0.9)] * 3 + [SamplingParams()] * 2,
        real=1100)
    add("a_shard_of_padding", [SamplingParams(temperature=1.0, top_k=20)] * 3 + [SamplingParams()] * 2, real=500)
    return out


def _sampler_worker(rank, world, port, out_dir):
    join_ranks(rank, world, port, "cpu")
    from dist import parallel
    try:
        size = V // world
        got = {}
        for name, logits, params, real, sup in cases():
            shard = logits[:, rank * size:(rank + 1) * size].contiguous()
            for hints in (True, False):
                batch = make_batch(params, engine_seed=3, counters=list(range(len(params))), suppress=sup,
                                   hints=hints)
                got[name, hints] = (sample_fast(shard, batch, real, V), sample_torch(shard, batch, real, V))
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_shards_sample_the_gathered_tokens(tmp_path, world):
    mp.start_processes(_sampler_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, logits, params, real, sup in cases():
        for hints in (True, False):
            batch = make_batch(params, engine_seed=3, counters=list(range(len(params))), suppress=sup, hints=hints)
            want = sample_torch(logits, batch, real, V)  # one process, whole rows
            for r in range(world):
                fast, gathered = ranks[r][name, hints]
                assert torch.equal(gathered, want), (name, hints, r)
                assert torch.equal(fast, want), (name, hints, r, fast.tolist(), want.tolist())
            assert max(want.tolist()) < real
            banned = set(sup)
            assert not any((i, t) in banned for i, t in enumerate(want.tolist())), name
    # the cases mean something: greedy ties pick the lowest id; the filters' ties keep the lowest ids
    by_name = {c[0]: c for c in cases()}
    _, logits, params, real, _ = by_name["greedy"]
    assert sample_torch(logits, make_batch(params), real, V).tolist() == [500] * len(params)
    _, logits, params, real, sup = by_name["greedy_suppressed"]
    assert sample_torch(logits, make_batch(params, suppress=sup), real, V).tolist() == [500, 520, 760, 1020]
    _, logits, params, real, _ = by_name["top_k_tie"]
    out = sample_torch(logits, make_batch(params, engine_seed=3), real, V).tolist()
    spanning = sorted(set(range(500, 540)) | set(range(760, 780)) | set(range(1020, 1030)))
    for p, t in zip(params, out):
        assert t in spanning[:p.top_k], (p.top_k, t)


# ---- the engine at TP=2 --------------------------------------------------------------------------------------------

def _engine_requests():
    from test_engine import GREEDY, PROMPTS
    return [("greedy0", PROMPTS[0], GREEDY),
            ("seeded", PROMPTS[2], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, min_tokens=12,
                                                  seed=77)),
            ("unseeded", PROMPTS[5], SamplingParams(temperature=0.8, max_tokens=10)),
            ("top_k", PROMPTS[3], SamplingParams(temperature=1.0, top_k=5, max_tokens=10, seed=5)),
            ("both", PROMPTS[1], SamplingParams(temperature=1.2, top_k=40, top_p=0.5, max_tokens=10))]


def _engine_worker(rank, port, tiny_dir, cache_dir, out_path):
    join_ranks(rank, 2, port, "cpu", QWEN35_CACHE=cache_dir)
    from dist import parallel
    from layers import sampler
    from test_engine import make_engine, run
    sampler.shard_pass_fast = sampler.shard_pass_torch  # the kernel's twin: the interpreter is too slow at 248k ids
    checked = {"steps": 0, "sampled": 0}

    def both_ways(logits, batch, num_real, vocab):
        fast = sample_fast(logits, batch, num_real, vocab)
        gathered = sample_torch(logits, batch, num_real, vocab)
        if not torch.equal(fast, gathered):
            raise AssertionError(f"rank {rank}: vocab-parallel {fast.tolist()} != gathered {gathered.tolist()}")
        checked["steps"] += 1
        checked["sampled"] += not batch.greedy_only
        return fast

    try:
        eng = make_engine(tiny_dir, tp=2)
        eng.sampler.impl = both_ways
        if rank == 0:
            done, _ = run(eng, _engine_requests(), arrive_every=1)
            eng.shutdown()
            torch.save(({k: v[0] for k, v in done.items()}, checked), out_path)
        else:
            eng.run_worker_loop()
            torch.save(checked, out_path + ".worker")
    finally:
        parallel.destroy()


def test_engine_tp2_samples_from_shards(tiny_dir, cache_dir, tmp_path):
    from test_engine import make_engine, run
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_engine_worker, args=(free_port(), tiny_dir, cache_dir, out), nprocs=2)
    got, checked = torch.load(out)
    assert checked == torch.load(out + ".worker")  # the worker sampled every step too
    assert checked["sampled"] >= 10 and checked["steps"] > checked["sampled"]
    tp1, _ = run(make_engine(tiny_dir), _engine_requests(), arrive_every=1)
    assert got["greedy0"] == tp1["greedy0"][0]  # and the gathered path at TP=1 agrees
    assert all(len(got[r]) == p.max_tokens for r, _, p in _engine_requests())


# ---- GPU (pytest -m gpu) ---------------------------------------------------------------------------------------

GPU_VOCAB, GPU_REAL = 248320, 248077


def gpu_batch(rows: int, step: int, gen: torch.Generator, hints: bool = True):
    """Rows of every kind at the real vocabulary: greedy, temperatures, top-k, top-p, both, seeded and not."""
    kinds = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, seed=3),
             SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
             SamplingParams(temperature=1.5, top_k=2000, seed=9), SamplingParams(temperature=1.0, top_p=0.3)]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    ids = torch.randint(0, GPU_VOCAB + 50, (3 * rows,), generator=gen).tolist()
    sup = [(i % rows, t) for i, t in enumerate(ids)]
    batch = make_batch(params, engine_seed=5, counters=[step] * rows, suppress=sup, hints=hints)
    for f in ("temperature", "top_k", "top_p", "key", "counter"):
        setattr(batch, f, getattr(batch, f).cuda())
    batch.suppress = tuple(t.cuda() for t in batch.suppress)
    return batch


@pytest.mark.gpu
def test_gpu_shard_pass_computes_the_torch_twins_bits():
    """The compiled kernel (no FMA contraction) gives the torch twin's bits at the real vocabulary size: the same
    noise, scores and candidates, so sample_fast on CUDA is sample_torch's sampler."""
    from layers.sampler import shard_pass_fast, shard_pass_torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, start, n in ((1, 0, GPU_VOCAB), (64, 124160, 124160), (8, 217280, 31040)):
        logits = torch.randn(rows, n, device="cuda", generator=gen) * 4
        n_valid = min(n, GPU_REAL - start)
        inv_t = torch.rand(rows, device="cuda", generator=gen) + 0.3
        key = torch.randint(-2**63, 2**63 - 1, (rows,), device="cuda", generator=gen)
        ctr = torch.randint(0, 2**40, (rows,), device="cuda", generator=gen)
        got = shard_pass_fast(logits, n_valid, start, inv_t, key, ctr, sampled=True, write_scores=True)
        want = shard_pass_torch(logits, n_valid, start, inv_t, key, ctr, sampled=True, write_scores=True)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (rows, start, (g != w).sum().item())


@pytest.mark.gpu
def test_gpu_sample_fast_equals_torch_without_a_host_sync():
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 64):
        logits = torch.randn(rows, GPU_VOCAB, generator=gen).cuda() * 3
        for step in range(3):
            for hints in (True, False):
                batch = gpu_batch(rows, step, gen, hints)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fast = sample_fast(logits, batch, GPU_REAL, GPU_VOCAB)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                assert torch.equal(fast, sample_torch(logits, batch, GPU_REAL, GPU_VOCAB)), (rows, step, hints)


def _gpu_worker(rank, world, port, out_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from dist import parallel
    parallel.init_distributed("cuda")
    errors = []
    try:
        size = GPU_VOCAB // world
        gen = torch.Generator().manual_seed(2)  # the same rows on every rank
        for rows in (1, 64):
            full = torch.randn(rows, GPU_VOCAB, generator=gen) * 3
            shard = full[:, rank * size:(rank + 1) * size].contiguous().cuda()
            for step in range(2):
                batch = gpu_batch(rows, step, gen)
                fast = sample_fast(shard, batch, GPU_REAL, GPU_VOCAB)
                gathered = sample_torch(shard, batch, GPU_REAL, GPU_VOCAB)
                if not torch.equal(fast, gathered) or not bool((parallel.all_gather(fast) == fast).all()):
                    errors.append(f"rank {rank} rows {rows} step {step}: {fast.tolist()} vs {gathered.tolist()}")
    finally:
        if rank == 0:
            torch.save(errors, out_file)
        parallel.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_shards_sample_the_gathered_tokens(tmp_path):
    out_file = str(tmp_path / "errors.pt")
    mp.start_processes(_gpu_worker, args=(2, free_port(), out_file), nprocs=2, join=True, start_method="spawn")
    assert torch.load(out_file) == []
