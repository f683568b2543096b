"""The bench's results file: what every one starts with, where it goes by default, and writing it."""
from __future__ import annotations

import datetime
import json
import sys

import torch

from dist import parallel


def device_name(runner) -> str:
    return torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu"


def header(eargs, dev: str, runner, argv) -> dict:
    """Date, device, TP, model and the command line that made the file."""
    return {"date": datetime.date.today().isoformat(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": dev, "tp": parallel.tp_size(), "model": eargs.model, "load_format": eargs.load_format,
            "dtype": str(runner.dtype), "kernels": runner.kernels,
            "command": f"torchrun --nproc-per-node {parallel.tp_size()} -m qwen35.bench "
                       + " ".join(sys.argv[1:] if argv is None else argv)}


def default_out(kind: str, dev: str) -> str:
    slug = dev.replace("NVIDIA ", "").replace(" ", "").lower()
    return f"benchmarks/results/{datetime.date.today().isoformat()}_{kind}_{slug}_tp{parallel.tp_size()}.json"


def write(out: str | None, results: dict) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {out}")
