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
