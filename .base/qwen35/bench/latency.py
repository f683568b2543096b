"""Single-request latency (`qwen35.bench --mode latency [--compare-hf]`): one request at a time, prompt P random
tokens, exactly O output tokens (greedy, EOS ignored), through the whole engine (scheduler, CUDA graphs, sampler,
detokenizer), for each shape of `--latency-shapes` (default 64:128, 2048:256, 8192:256, the shapes single-GPU users
of the dense Qwen3.5 models measure). Per shape: end-to-end ms (add_request to the last token), time to the first
token, ms per later token; the median of `reps` runs after a warm-up (transformers: of `hf_reps`, by default one:
it compiles nothing, and its runs are long).

With --compare-hf (TP=1): transformers' `generate` on the same weights (our dummy weights copied into the
transformers model of the same config, same device and dtype, its default attention and, for Qwen3.5's DeltaNet,
whatever fallback transformers picks without optional kernels), same prompts and output lengths, timed the same
way, in the same process; and how many leading greedy tokens the two agree on (random bf16 weights make greedy
decoding chaotic, so only the first few are expected to agree).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import time

import torch

from qwen35.bench.engine_runs import prompt_vocab

DEFAULT_SHAPES = "64:128,2048:256,8192:256"


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """"P:O,P:O" -> [(P, O), ...]."""
    try:
        shapes = [tuple(int(x) for x in item.split(":")) for item in spec.split(",") if item]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"latency shapes: expected PROMPT:OUTPUT[,PROMPT:OUTPUT...], got {spec!r}")
    return shapes


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_run(engine, prompt: list[int], output_len: int, tag: str) -> dict:
    """One request alone through LLMEngine: ms to the end, ms to the first token, and its tokens."""
    from scheduler.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens, first = [], None
    t0 = time.perf_counter()
    engine.add_request(tag, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():  # the sampled tokens reach the host each step: no extra sync needed
            tokens += out.token_ids
            if first is None and out.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ms": 1e3 * (end - t0), "ttft_ms": 1e3 * (first - t0), "tokens": tokens,
            "tpot_ms": 1e3 * (end - first) / max(1, output_len - 1)}


def build_hf_model(engine):
    """The transformers causal LM of the engine's config, holding the engine's weights (TP=1)."""
    import transformers
    from dist import parallel
    if parallel.tp_size() != 1:
        raise SystemExit("--compare-hf runs transformers on one GPU: use TP=1")
    with open(os.path.join(engine.model_dir, "config.json")) as f:
        raw = json.load(f)
    text = raw.get("text_config") or raw
    cfg = engine.config
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}.get(cfg.model_type)
    if names is None:
        names = ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM") if cfg.is_moe else \
            ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")
    config_cls, model_cls = (getattr(transformers, n) for n in names)
    hf_config = config_cls.from_dict({k: v for k, v in text.items() if k != "model_type"})
    hf_config.tie_word_embeddings = cfg.tie_word_embeddings
    runner = engine.runner
    with torch.device(runner.device):
        hf = model_cls._from_config(hf_config, dtype=runner.dtype).eval()
    ours = {(n if n == "lm_head.weight" else "model." + n): p for n, p in runner.model.named_parameters()}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"our weights do not map onto {model_cls.__name__}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return hf


def hf_run(hf, prompt: list[int], output_len: int) -> dict:
    dev = hf.device
    ids = torch.tensor([prompt], device=dev)
    _sync(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    _sync(dev)
    return {"ms": 1e3 * (time.perf_counter() - t0), "tokens": out[0, len(prompt):].tolist()}


def latency(engine, shapes: list[tuple[int, int]], reps: int, compare_hf: bool, rng: random.Random,
            hf_reps: int = 1) -> dict:
    vocab = prompt_vocab(engine)
    hf = build_hf_model(engine) if compare_hf else None
    warm = [rng.randrange(vocab) for _ in range(16)]
    engine_run(engine, warm, 4, "latency-warm")
    if hf is not None:
        hf_run(hf, warm, 4)
    rows = []
    for p, o in shapes:
        # a new prompt every run: a repeated one would be served from the prefix cache
        prompts = [[rng.randrange(vocab) for _ in range(p)] for _ in range(max(reps, hf_reps))]
        runs = [engine_run(engine, prompts[r], o, f"latency-{p}-{o}-{r}") for r in range(reps)]
        row = {"prompt": p, "output": o, "reps": reps,
               "ms": round(statistics.median(r["ms"] for r in runs), 1),
               "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 2),
               "tpot_ms": round(statistics.median(r["tpot_ms"] for r in runs), 3)}
        if hf is not None:
            hf_runs = [hf_run(hf, prompts[r], o) for r in range(hf_reps)]
            row["hf_ms"] = round(statistics.median(r["ms"] for r in hf_runs), 1)
            row["speedup"] = round(row["hf_ms"] / row["ms"], 2)
            ours, theirs = runs[0]["tokens"], hf_runs[0]["tokens"]
            row["greedy_tokens_agreeing"] = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                                                 min(len(ours), len(theirs)))
        rows.append(row)
        print(f"  {p:5d} / {o:4d}: {row['ms']:9.1f} ms (TTFT {row['ttft_ms']:.1f} ms, {row['tpot_ms']:.2f} ms/token)"
              + (f"   transformers {row['hf_ms']:9.1f} ms ({row['speedup']:.2f}x), greedy agree "
                 f"{row['greedy_tokens_agreeing']} tokens" if hf is not None else ""), flush=True)
    return {"rows": rows, "compare_hf": compare_hf, "hf_reps": hf_reps if compare_hf else 0}
