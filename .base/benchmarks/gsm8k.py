"""GSM8K correctness gate (serving contract section 4), against a running server.

    python -m benchmarks.gsm8k --url http://127.0.0.1:8000 [--data benchmarks/data/gsm8k] [--limit 200]
        [--concurrency 8] [--samples-log benchmarks/results/gsm8k-samples.jsonl] [--out gsm8k.json] [--gate 0.875]

8-shot chain of thought as multi-turn chat (user "Q: ...\\nA:", assistant "<reasoning> The answer is N.", then the
question), temperature 0, max_tokens 256, the contract's stop strings and seed. Scores as lm-eval's gsm8k_cot:
strict = first "The answer is N.", flexible = the last number in the answer; commas, "$" and a trailing "." are
ignored; exact match against the number after "####". `--max-tokens` below 256 is for smoke tests only.
The data (the first 200 test problems and the 8 exemplars, MIT licence) ships in benchmarks/data/gsm8k/; the
per-sample log goes to benchmarks/results/ unless --samples-log says otherwise (never the working directory).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import sys

from benchmarks.common import add_server_args, client, closed_loop, served_model

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "gsm8k")
DEFAULT_SAMPLES_LOG = os.path.join(HERE, "results", "gsm8k-samples.jsonl")  # ignored by git
STRICT = re.compile(r"The answer is (\-?[0-9\.\,]+).")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE = [re.compile(r) for r in (",", r"\$", r"(?s).*#### ", r"\.$")]


def normalize(text: str) -> str:
    for pattern in IGNORE:
        text = pattern.sub("", text)
    return text.strip()


def extract_strict(text: str) -> str | None:
    m = STRICT.search(text)
    return m.group(1) if m else None


def extract_flexible(text: str) -> str | None:
    matches = FLEXIBLE.findall(text)
    return next(g for g in matches[-1] if g) if matches else None


def load_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def messages_for(shots: list[dict], question: str) -> list[dict]:
    messages = []
    for shot in shots:
        messages += [{"role": "user", "content": f"Q: {shot['question']}\nA:"},
                     {"role": "assistant", "content": shot["answer"]}]
    return messages + [{"role": "user", "content": f"Q: {question}\nA:"}]


async def run(args) -> tuple[dict, list[dict]]:
    shots = load_jsonl(os.path.join(args.data, "cot_8shot.jsonl"))
    problems = load_jsonl(os.path.join(args.data, "test.jsonl"))[:args.limit]
    async with client(args, args.concurrency) as http:
        model = await served_model(http, args.model)
        payloads = [{"model": model, "messages": messages_for(shots, p["question"]), "max_tokens": args.max_tokens,
                     "temperature": 0, "top_p": 1.0, "stop": ["Q:", "</s>", "<|im_end|>"], "seed": 1234}
                    for p in problems]
        results, wall = await closed_loop(http, payloads, args.concurrency)
    samples = []
    for problem, res in zip(problems, results):
        target = normalize(problem["answer"])
        strict, flexible = extract_strict(res.content), extract_flexible(res.content)
        samples.append({
            "index": res.index, "question": problem["question"], "target": target, "response": res.content,
            "finish_reason": res.body["choices"][0]["finish_reason"] if res.ok else None,
            "usage": res.body.get("usage") if res.ok else None, "error": res.error,
            "strict": strict, "flexible": flexible,
            "strict_match": strict is not None and normalize(strict) == target,
            "flexible_match": flexible is not None and normalize(flexible) == target,
        })
    n = len(samples)
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "url": args.url, "model": model, "num_samples": n,
        "max_tokens": args.max_tokens, "concurrency": args.concurrency, "wall_s": round(wall, 2),
        "strict_match": sum(s["strict_match"] for s in samples) / n,
        "flexible_match": sum(s["flexible_match"] for s in samples) / n,
        "errors": sum(s["error"] is not None for s in samples),
    }
    return summary, samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--data", default=DEFAULT_DATA, help="directory with test.jsonl and cot_8shot.jsonl")
    p.add_argument("--limit", type=int, default=200, help="first N test problems")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=256, help="the contract says 256; lower only for smoke tests")
    p.add_argument("--samples-log", default=DEFAULT_SAMPLES_LOG, help="per-sample JSONL log")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--gate", type=float, default=None, help="exit 1 when flexible and strict are both below this")
    args = p.parse_args(argv)
    summary, samples = asyncio.run(run(args))
    os.makedirs(os.path.dirname(os.path.abspath(args.samples_log)), exist_ok=True)
    with open(args.samples_log, "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    print(f"GSM8K {summary['num_samples']} problems in {summary['wall_s']} s: strict {summary['strict_match']:.2%}, "
          f"flexible {summary['flexible_match']:.2%}, errors {summary['errors']} (samples in {args.samples_log})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    failed_gate = args.gate is not None and max(summary["strict_match"], summary["flexible_match"]) < args.gate
    return 1 if summary["errors"] or failed_gate else 0


if __name__ == "__main__":
    sys.exit(main())
