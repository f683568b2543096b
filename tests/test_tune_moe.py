"""benchmarks/tune_moe.py's table merge (the GPU tuning itself runs on a GPU only): runs of one TP each, tuned side by
side from copies of one table, give one table with every entry each run changed and the rest as it was; and a
re-tune's choice between the tile it started from and its grid's best."""
import json
import subprocess
import sys

from benchmarks.tune_moe import merge_tables
from tests.test_server import ROOT

BASE = {"NVIDIA H200": {"E256_H2048_I128": {"1": {"gemv": "a"}, "32": {"scan": None}},
                        "E256_H2048_I256": {"1": {"gemv": "b"}, "16": {"scan": None}}},
        "NVIDIA H100 80GB HBM3": {"E256_H2048_I512": {"1": {"gemv": "c"}}}}


def tuned(key, bucket, entry):
    table = json.loads(json.dumps(BASE))
    table["NVIDIA H200"][key][bucket] = entry
    return table


def test_merge_keeps_what_each_run_changed():
    tp4 = tuned("E256_H2048_I128", "32", {"scan": {"gate_up": 1}})
    tp2 = tuned("E256_H2048_I256", "16", {"scan": {"gate_up": 2}})
    tp2["NVIDIA H200"]["E256_H2048_I256"]["64"] = {"gemv": None}  # a bucket the base lacks
    merged = merge_tables(BASE, [tp4, tp2])
    assert merged["NVIDIA H200"]["E256_H2048_I128"]["32"] == {"scan": {"gate_up": 1}}
    assert merged["NVIDIA H200"]["E256_H2048_I256"]["16"] == {"scan": {"gate_up": 2}}
    assert merged["NVIDIA H200"]["E256_H2048_I256"]["64"] == {"gemv": None}
    assert merged["NVIDIA H200"]["E256_H2048_I128"]["1"] == {"gemv": "a"}  # unchanged by both: as it was
    assert merged["NVIDIA H100 80GB HBM3"] == BASE["NVIDIA H100 80GB HBM3"]
    assert BASE["NVIDIA H200"]["E256_H2048_I128"]["32"] == {"scan": None}  # the base itself untouched


def test_merge_from_the_command_line(tmp_path):
    out, a = tmp_path / "moe_configs.json", tmp_path / "tp4.json"
    out.write_text(json.dumps(BASE))
    a.write_text(json.dumps(tuned("E256_H2048_I128", "32", {"scan": {"gate_up": 1}})))
    r = subprocess.run([sys.executable, "-m", "benchmarks.tune_moe", "--merge", str(a), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["NVIDIA H200"]["E256_H2048_I128"]["32"] == {"scan": {"gate_up": 1}}


def test_retune_keeps_the_faster_of_old_and_new():
    from benchmarks.tune_moe import faster
    old, new = (18.7, {"BLOCK_N": 16}), (19.3, {"BLOCK_N": 8})
    assert faster(new, old) == old and faster(old, new) == old and faster((18.0, {"BLOCK_N": 8}), old)[0] == 18.0
    assert faster((18.7, {"BLOCK_N": 8}), old) == old  # a tie keeps what the table had


def test_confirm_keeps_a_new_entry_only_where_it_is_faster_beyond_chance():
    from benchmarks.tune_moe import holds
    # TP=8's bucket 8 on 2026-11-30 (ranges apart, us): the new entry holds
    old = [25.8 + 0.05 * i for i in range(14)]
    new = [24.05 + 0.045 * i for i in range(14)]
    assert holds(new, old) and not holds(old, new)
    # the same spread, shifted by a tenth of it: chance
    assert not holds([t - 0.06 for t in old], old)
    # identical timings are no gain (ties count half)
    assert not holds(old, old)
    # overlapping ranges but a consistent shift over many rounds: it holds
    import random
    rng = random.Random(0)
    base = [rng.gauss(35.0, 1.0) for _ in range(14)]
    assert holds([t - 2.0 for t in base], [rng.gauss(35.0, 1.0) for _ in range(14)])
