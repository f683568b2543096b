"""The kernel switch (layers/backend.py) and its shared Triton helper round_to, through the interpreter on the CPU."""
import pytest
import torch

from layers import backend
from layers.backend import round_to, tl, triton


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, round_to(x, DTYPE), mask=i < n)


@pytest.mark.parametrize("dtype,tl_dtype", [(torch.bfloat16, tl.bfloat16), (torch.float32, tl.float32)])
def test_round_to_equals_torch_cast(dtype, tl_dtype):
    """Round-to-nearest-even, ties included: every value equals torch's x.to(dtype).float() exactly."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=gen) * 10 ** torch.randint(-8, 8, (4000,), generator=gen),
                   # exact ties between two bf16 values: the even one wins
                   torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 0.0, -0.0])])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = x.to(device)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), DTYPE=tl_dtype, BLOCK=1024)
    want = x.to(dtype).float()
    assert torch.equal(out, want)
    if dtype == torch.bfloat16:
        assert not torch.equal(out, x)  # it did round


def test_resolve_and_switch(monkeypatch):
    monkeypatch.delenv(backend.ENV, raising=False)
    assert backend.resolve(None, "cpu") == "torch"
    monkeypatch.setenv(backend.ENV, "fast")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.resolve(None, "cpu")  # fast on the CPU only through the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.resolve(None, "cpu") == "fast"
    assert backend.resolve("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="kernels must be one of"):
        backend.resolve("cuda-graphs", "cpu")
    before = backend.kernels()
    with backend.use_kernels("fast"):
        assert backend.use_fast()
    assert backend.kernels() == before


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bfloat16])
def test_empty_aligned_parts_start_on_16_bytes(dtype):
    """Every part of the shared allocation starts 16-byte aligned and has its own size, whatever the sizes before."""
    sizes = [1, 3, 0, 7, 16, 5]
    parts = backend.empty_aligned(sizes, dtype, "cpu")
    assert [p.numel() for p in parts] == sizes
    assert all(p.data_ptr() % 16 == 0 for p in parts)
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1  # one allocation
    assert backend.aligned_sizes([1, 2, 3], torch.int64) == [2, 2, 4]


def test_on_compile_calls_back_chains_and_stops(monkeypatch):
    """on_compile wraps Triton's jit_cache_hook: the callback sees each compile's description, a hook set before it
    still runs (and its answer is passed on), and stop() puts the earlier hook back."""
    knobs = pytest.importorskip("triton").knobs
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: earlier.append(kw["repr"]))
    seen = []
    stop = backend.on_compile(seen.append)
    assert knobs.runtime.jit_cache_hook(repr="_k[num_warps=4](x_ptr: *bf16)", key=None) is None
    assert seen == ["_k[num_warps=4](x_ptr: *bf16)"] and earlier == seen
    stop()
    knobs.runtime.jit_cache_hook(repr="_j", key=None)
    assert seen == ["_k[num_warps=4](x_ptr: *bf16)"] and earlier[-1] == "_j"


def test_early_launch_at_one_row_past_tp1_with_pdl(monkeypatch):
    """The kernels before a GEMV let it launch early at one row and TP > 1 only, and only where PDL is on (on the
    CPU it never is: the interpreter runs launches in order)."""
    from dist import parallel
    assert not backend.early_launch(1)  # (the CPU: no PDL)
    monkeypatch.setattr(backend, "pdl", lambda: {"launch_pdl": True})
    monkeypatch.setattr(parallel, "tp_size", lambda: 2)
    assert backend.early_launch(1)
    assert not backend.early_launch(2) and not backend.early_launch(64)
    monkeypatch.setattr(parallel, "tp_size", lambda: 1)
    assert not backend.early_launch(1)
    monkeypatch.setattr(parallel, "tp_size", lambda: 8)
    monkeypatch.setattr(backend, "pdl", lambda: {})
    assert not backend.early_launch(1)
