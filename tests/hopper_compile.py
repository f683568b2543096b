"""Compile, for a Hopper GPU (sm_90), the Triton kernel variants that CPU code launches through the interpreter.

The interpreter accepts some code the compiler does not (a jit function returning a dtype, for one), so a kernel
checked only on the CPU can still fail to compile on the device. `recorded()` notes every interpreted launch's
signature (argument types, constexpr values, warps); `compile_all` compiles each (or a `variant` of it) in a fresh
Python process without the interpreter, through Triton's own compiler and ptxas (no GPU needed), and returns the
failures."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys

import torch
from triton.runtime.interpreter import InterpretedFunction

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _type(v) -> str:
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[v.dtype]
    raise TypeError(f"no Triton type for {type(v).__name__}")


def _constexpr(v):
    return str(v) if not isinstance(v, (int, float, bool, str, type(None))) else v


@contextlib.contextmanager
def recorded():
    """Yields a list filled with one entry per distinct interpreted launch in the block (the launches still run)."""
    launches, seen = [], set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        sig = inspect.signature(fn)
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        signature, constexprs = {}, {}
        for name, p in sig.parameters.items():
            if "constexpr" in str(p.annotation):
                signature[name] = "constexpr"
                v = bound.arguments.get(name, p.default)
                constexprs[name] = _constexpr(v)
            elif name in bound.arguments:
                signature[name] = _type(bound.arguments[name])
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
                 "options": options}
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


_COMPILER = r'''
import importlib, json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32, "int16": tl.int16, "int32": tl.int32,
          "int64": tl.int64}  # (constexpr dtypes, recorded as str(tl dtype))
failures = []
for e in json.load(sys.stdin):
    fn = getattr(importlib.import_module(e["module"]), e["name"])
    consts = {k: DTYPES.get(v, v) if isinstance(v, str) else v for k, v in e["constexprs"].items()}
    try:
        triton.compile(ASTSource(fn=fn, signature=e["signature"], constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=e["options"])
    except Exception as exc:
        failures.append(f"{e['module']}.{e['name']} {e['constexprs']}: {type(exc).__name__}: {str(exc)[:600]}")
print(json.dumps(failures))
'''


def variant(launch: dict, options: dict | None = None, **constexprs) -> dict:
    """A copy of a recorded launch with some constexprs (and compile options, e.g. num_warps) changed: a setting the
    CPU did not launch (a GPU shape's tile), compiled as that launch would be."""
    entry = json.loads(json.dumps(launch))
    entry["constexprs"].update(constexprs)
    entry["options"].update(options or {})
    return entry


def compile_all(launches: list[dict], timeout: float = 900) -> list[str]:
    """Compile every recorded launch for sm_90 in a subprocess; the failures, each with its error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(launches), capture_output=True,
                         text=True, env=env, timeout=timeout, cwd=root)
    if out.returncode:
        return [f"compiler process failed: {out.stderr[-2000:]}"]
    return json.loads(out.stdout.strip().splitlines()[-1])


def hopper_backend_available() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True
