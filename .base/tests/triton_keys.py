"""The compile keys of Triton launches, recorded on the CPU (Triton's interpreter), to test that a warm-up meets
every kernel variant that serving can meet.

On a GPU Triton compiles a kernel once per key: its constexpr values, launch options, and the specialisations of its
other arguments unless the kernel opts out (do_not_specialize / do_not_specialize_on_alignment): an integer equal to
1 becomes a constant, an integer divisible by 16 and a pointer aligned to 16 bytes are marked so. `record` computes
that key for every interpreted launch by the same rules (Triton's specialize_impl). With skip=True the launches do
not run (their outputs stay uninitialised): a step's kernels and keys follow from its shapes and plan, not from the
values, and the interpreter is slow.
"""
from __future__ import annotations

import collections
import contextlib
import inspect

import torch
from triton.runtime.interpreter import InterpretedFunction


def _spec(value, specialize: bool, align: bool) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        if specialize and value == 1:
            return "=1"
        return "iD" if specialize and align and value % 16 == 0 else "i"
    if isinstance(value, float):
        return "f"
    if isinstance(value, torch.Tensor):
        aligned = specialize and align and value.data_ptr() % 16 == 0
        return f"*{value.dtype}" + ("D" if aligned else "")
    return type(value).__name__


def launch_key(fn: InterpretedFunction, args: tuple, kwargs: dict) -> tuple:
    sig = inspect.signature(fn.fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    dns = set(fn.kwargs.get("do_not_specialize") or ())
    dnsa = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    parts = []
    for i, (name, p) in enumerate(sig.parameters.items()):
        if name not in bound.arguments:
            continue
        v = bound.arguments[name]
        if "constexpr" in str(p.annotation):
            parts.append(f"{name}={v}")
        else:
            parts.append(f"{name}:{_spec(v, name not in dns and i not in dns, name not in dnsa and i not in dnsa)}")
    options = tuple(f"{k}={v}" for k, v in sorted(kwargs.items()) if k not in sig.parameters)
    return tuple(parts) + options


@contextlib.contextmanager
def record(skip: bool = True):
    """Yields {kernel name: set of keys} filled by every interpreted launch in the block."""
    keys: dict[str, set] = collections.defaultdict(set)
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        keys[self.fn.__qualname__].add(launch_key(self, args, kwargs))
        return None if skip else run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield keys
    finally:
        InterpretedFunction.run = run


def unmet(keys: dict, met: dict) -> list[str]:
    """Each key in `keys` that `met` lacks, with the parts in which it differs from the nearest key met."""
    out = []
    for name, ks in sorted(keys.items()):
        for k in ks - met.get(name, set()):
            near = min(met.get(name, ()), key=lambda m: sum(a != b for a, b in zip(m, k)), default=None)
            diff = [(a, b) for a, b in zip(near, k) if a != b] if near else "no key of this kernel met"
            out.append(f"{name}: {diff}")
    return out
