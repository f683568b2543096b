"""The benchmark clients: their pieces, then throughput / GSM8K / check_server end to end against the tiny model
served by ./start.sh (small counts; synthetic weights, so the scores themselves are meaningless here)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from benchmarks import gsm8k, throughput
from benchmarks.common import Counter
from benchmarks.gsm8k import DEFAULT_DATA, extract_flexible, extract_strict, load_jsonl, messages_for, normalize
from benchmarks.throughput import output_lengths
from qwen35.bench.workload import random_prompt
from qwen35.bench.workload import STANDARD_OUTPUT_LEN_DIST
from test_server import ROOT, free_port, start_tiny, stop_tiny


def run_client(module: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    return r


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    port, log = free_port(), str(tmp_path_factory.mktemp("clients") / "server.log")
    yield start_tiny(port, log)
    stop_tiny(port, log)


@pytest.mark.parametrize("length", [16, 300, 1024])
def test_random_prompt_is_exactly_length_tokens(length):
    counter, rng = Counter(None), random.Random(length)
    for _ in range(5):
        assert len(counter.tok.encode(random_prompt(counter, length, rng))) == length


def test_output_lengths():
    rng = random.Random(0)
    assert output_lengths(None, 3, 1024, rng) == [1024] * 3
    assert output_lengths("fixed:7", 2, 1024, rng) == [7, 7]
    uniform = output_lengths("uniform:5-9", 200, 1024, rng)
    assert set(uniform) == set(range(5, 10))
    normal = output_lengths("normal:100,10", 500, 1024, rng)
    assert 95 < sum(normal) / len(normal) < 105 and min(normal) >= 1
    for bad in ("poisson:3", "exp:290", "exp:-1,10", "fixed:x"):
        with pytest.raises(SystemExit):
            output_lengths(bad, 2, 1024, rng)


def test_standard_output_lengths_are_exponential_capped_and_seeded():
    assert STANDARD_OUTPUT_LEN_DIST == "exp:290,1024"
    lengths = output_lengths("exp:290,1024", 20000, 0, random.Random(0))
    assert lengths == output_lengths("exp:290,1024", 20000, 0, random.Random(0))  # seeded
    assert min(lengths) >= 1 and max(lengths) == 1024  # capped: P(draw > 1024) = 2.9%
    # mean of min(Exp(290), 1024) = 290 * (1 - exp(-1024 / 290)) = 281.5
    assert 275 < sum(lengths) / len(lengths) < 288
    assert sum(n == 1024 for n in lengths) / len(lengths) == pytest.approx(0.029, abs=0.005)


def test_throughput_defaults_to_the_standard_lengths(monkeypatch):
    seen = {}

    async def fake_run(args):
        seen.update(vars(args))
        raise SystemExit(0)

    monkeypatch.setattr(throughput, "run", fake_run)
    for argv, dist in (([], STANDARD_OUTPUT_LEN_DIST), (["--output-len-dist", "none"], None)):
        with pytest.raises(SystemExit):
            throughput.main(argv)
        assert seen["output_len_dist"] == dist


def test_gsm8k_data_ships_with_the_repo():
    assert os.path.commonpath([DEFAULT_DATA, ROOT]) == ROOT
    problems = load_jsonl(os.path.join(DEFAULT_DATA, "test.jsonl"))
    shots = load_jsonl(os.path.join(DEFAULT_DATA, "cot_8shot.jsonl"))
    assert len(problems) == 200 and len(shots) == 8 and all("####" in p["answer"] for p in problems)
    assert "MIT License" in open(os.path.join(DEFAULT_DATA, "LICENSE")).read()
    for path in ("benchmarks", "tests", "qwen35", "server.py", "start.sh"):  # nothing reads a folder beside the repo
        r = subprocess.run(["grep", "-rEn", "--include=*.py", "--include=*.sh", "[.][.]/shared|[\"']shared[\"']",
                            path], cwd=ROOT, capture_output=True, text=True)
        assert r.stdout == "", r.stdout


def test_gsm8k_scoring():
    answer = "She has 3 + 1,000 = $1,003 dollars. The answer is 1,003."
    assert extract_strict(answer) == "1,003" and normalize(extract_strict(answer)) == "1003"
    assert extract_strict("so it is 12") is None and extract_flexible("so it is 12") == "12"
    assert normalize(extract_flexible("The total is $1,200.")) == "1200"
    assert normalize("Janet sells 9 eggs.\n#### 1,018") == "1018"
    assert extract_flexible("no digits") is None


def test_throughput_line_says_what_speculation_did():
    """A level's line adds the server's drafts and verify steps when it drafted any (benchmarks.throughput)."""
    assert throughput._speculation({"num_steps": 90, "spec_drafted_tokens": 0}) == ""
    line = throughput._speculation({"num_steps": 90, "spec_drafted_tokens": 50.0, "spec_accepted_tokens": 31.0,
                                    "spec_verify_graph_steps": 40.0, "spec_verify_eager_steps": 2.0})
    assert line == "  drafts 31/50 accepted, verify steps 40 graph + 2 eager of 90"


def test_throughput_end_to_end(url, tmp_path):
    out = tmp_path / "results.json"
    r = run_client("benchmarks.throughput", "--url", url, "--levels", "1,2", "--num-requests", "4",
                   "--output-len-dist", "fixed:12", "--device-info", "ci cpu", "--out", str(out))
    assert r.returncode == 0
    res = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    for lv in res["levels"]:
        assert lv["requests"] == 4 and lv["errors"] == 0 and lv["tok_s"] > 0, lv
        assert lv["server_usage"]["completion_tokens"] == 4 * 12 and lv["finish_reasons"]["length"] == 4, lv
        assert lv["server_usage"]["prompt_tokens"] == lv["prompt_tokens"]  # the client's count agrees
        assert 2 * 1030 < lv["prompt_tokens"] < 2 * 1045 + 2 * 40, lv  # 2 random prompts + 2 spot checks
        assert lv["spot_checks"]["total"] == 2
        counted = lv["server_counters"]  # (the server's /metrics over the level: its steps, no speculation)
        assert counted["num_steps"] >= 4 * 12 // lv["concurrency"] and counted["spec_drafted_tokens"] == 0, counted
    assert res["meta"]["device_info"] == "ci cpu" and res["meta"]["settings"]["output_lengths"] == [12] * 4
    assert res["weighted_score"] == pytest.approx(sum(lv["tok_s"] for lv in res["levels"]), rel=1e-3)
    assert "c=  1:" in r.stdout and "weighted score" in r.stdout


def test_gsm8k_end_to_end(url, tmp_path):
    samples, summary = tmp_path / "samples.jsonl", tmp_path / "summary.json"
    r = run_client("benchmarks.gsm8k", "--url", url, "--limit", "4", "--max-tokens", "16",
                   "--samples-log", str(samples), "--out", str(summary))
    assert r.returncode == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    shots = load_jsonl(os.path.join(DEFAULT_DATA, "cot_8shot.jsonl"))
    problems = load_jsonl(os.path.join(DEFAULT_DATA, "test.jsonl"))[:4]
    counter = Counter(None)
    assert [row["question"] for row in rows] == [p["question"] for p in problems]
    for row, problem in zip(rows, problems):
        assert row["error"] is None and row["target"] == normalize(problem["answer"])
        assert row["usage"]["prompt_tokens"] == counter.prompt(messages_for(shots, problem["question"]))
    assert json.loads(summary.read_text())["num_samples"] == 4


def test_gsm8k_writes_its_samples_under_benchmarks_results(url, tmp_path, monkeypatch):
    # by default the samples log goes to benchmarks/results/ (here redirected), never the working directory
    default = tmp_path / "results" / "gsm8k-samples.jsonl"
    assert gsm8k.DEFAULT_SAMPLES_LOG == os.path.join(ROOT, "benchmarks", "results", "gsm8k-samples.jsonl")
    monkeypatch.setattr(gsm8k, "DEFAULT_SAMPLES_LOG", str(default))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert gsm8k.main(["--url", url, "--limit", "1", "--max-tokens", "4"]) == 0
    assert len(default.read_text().splitlines()) == 1 and os.listdir(cwd) == []


def test_check_server_cli(url):
    assert run_client("benchmarks.check_server", "--url", url, "--only", "health,chat").returncode == 0
    dead = run_client("benchmarks.check_server", "--url", f"http://127.0.0.1:{free_port()}", "--only", "health")
    assert dead.returncode != 0
