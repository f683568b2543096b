"""Full-width bf16 parity on the GPU: our forward and transformers' bf16 forward, each against transformers in fp32.

    [torchrun --nproc-per-node N] python -m benchmarks.gpu_parity --layers 8 --prompts 4 --prompt-len 1024

Every layer has the real Qwen3.5-35B-A3B sizes (hidden 2048, 256 experts top-8, 16/2 attention heads, 16/32 DeltaNet
heads, vocab 248320); `--layers` keeps the first L layers of the real pattern (3 DeltaNet + 1 attention, repeated),
because an fp32 reference of all 40 layers (140 GB) fits on no single GPU. Every rank builds the same random
transformers model (same seed, checked), loads its shard of it into our model and runs the same prompts; rank 0
computes the references and prints the table. Ours must be no worse than 1.5x transformers' own bf16 error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from dist import parallel
from qwen35.checkpoint import load_state_dict
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from qwen35.synth import preset_text
from scheduler.plan import StepPlan


def build_reference(preset: str, layers: int, seed: int, device: str):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    text = preset_text(preset, layers)
    text.pop("dtype", None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text)).float().eval()
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():  # non-trivial norm weights, as a trained model has
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn(p.shape, generator=gen, device=device) * 0.1)
    return model, text


def errors(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (x.float() - ref).abs()
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item(),
            "rel_l2": ((x.float() - ref).norm() / ref.norm()).item(), "ref_mean_abs": ref.abs().mean().item(),
            "argmax_agree": (x.float().argmax(-1) == ref.argmax(-1)).float().mean().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b", help="sizes of each layer (tiny: a CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    rank, world = parallel.init_distributed(dev)
    t0 = time.time()
    hf, text = build_reference(args.preset, args.layers, args.seed, dev)
    # every rank must hold the same reference weights: compare a checksum
    check = torch.tensor([sum(p.float().sum().item() for p in hf.parameters())], device=dev, dtype=torch.float64)
    spread = [torch.zeros_like(check) for _ in range(world)]
    if world > 1:
        torch.distributed.all_gather(spread, check)
        assert all(torch.equal(s, check) for s in spread), "ranks built different reference weights"
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompts = [torch.randint(0, 248044, (args.prompt_len,), generator=gen) for _ in range(args.prompts)]

    refs = []
    if rank == 0:
        with torch.no_grad():
            for p in prompts:
                refs.append(hf(p[None].to(dev)).logits[0].float())
    config = ModelConfig.from_dict({"text_config": text})
    runner = ModelRunner(config, EngineArgs(model="", load_format="dummy", dtype="bfloat16", device=dev,
                                            max_num_seqs=args.prompts, max_model_len=args.prompt_len + 16,
                                            enforce_eager=True))
    load_state_dict(runner.model, hf.state_dict())
    ours = []
    blocks = -(-args.prompt_len // runner.block_size)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    t_ours = time.time()
    for i, p in enumerate(prompts):
        plan = StepPlan([i], [p.tolist()], [0], [list(range(i * blocks, (i + 1) * blocks))], [True])
        batch = runner.prepare(plan)
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(batch))
        if rank == 0:
            ours.append(logits)
    sync()
    t_ours = time.time() - t_ours
    hf = hf.to(torch.bfloat16)  # what from_pretrained(dtype=bf16) gives: A_log and the gated norm rounded too
    rows = []
    if rank == 0:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                hf_bf16 = hf(p[None].to(dev)).logits[0]
                rows.append({"prompt": i, "ours": errors(ours[i], refs[i]), "transformers_bf16": errors(hf_bf16, refs[i])})
        summary = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "tp": world, "layers": args.layers,
            "prompts": args.prompts, "prompt_len": args.prompt_len,
            "ours_max_abs": max(r["ours"]["max_abs"] for r in rows),
            "ours_mean_abs": sum(r["ours"]["mean_abs"] for r in rows) / len(rows),
            "hf_bf16_max_abs": max(r["transformers_bf16"]["max_abs"] for r in rows),
            "hf_bf16_mean_abs": sum(r["transformers_bf16"]["mean_abs"] for r in rows) / len(rows),
            "ours_prefill_s": t_ours / args.prompts, "wall_s": time.time() - t0, "rows": rows,
        }
        summary["ratio_mean"] = summary["ours_mean_abs"] / summary["hf_bf16_mean_abs"]
        summary["ratio_max"] = summary["ours_max_abs"] / summary["hf_bf16_max_abs"]
        summary["pass"] = summary["ratio_mean"] <= 1.5 and summary["ratio_max"] <= 1.5
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
        print(f"{'':10s} {'max|err|':>10s} {'mean|err|':>10s}   (vs transformers fp32; tp={world}, {args.layers} layers)")
        print(f"{'ours':10s} {summary['ours_max_abs']:10.4f} {summary['ours_mean_abs']:10.5f}")
        print(f"{'hf bf16':10s} {summary['hf_bf16_max_abs']:10.4f} {summary['hf_bf16_mean_abs']:10.5f}")
        print(f"ratio mean {summary['ratio_mean']:.3f} max {summary['ratio_max']:.3f} -> {'PASS' if summary['pass'] else 'FAIL'}"
              f"; argmax agreement ours {min(r['ours']['argmax_agree'] for r in rows):.4f}"
              f" hf-bf16 {min(r['transformers_bf16']['argmax_agree'] for r in rows):.4f}"
              f"; |ref| mean {rows[0]['ours']['ref_mean_abs']:.3f}")
    parallel.barrier()
    parallel.destroy()


if __name__ == "__main__":
    main()
