"""bench/tuning_value.py on replayed timings: the summary's numbers (tuned vs default, the single
best config and tuned vs it, "slower than the default beyond noise") against values worked out
by hand from the recording; bad arguments fail with a message naming them."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from flashtune import targets
from flashtune.codegen import Variant
from flashtune.defaults import default_variant
from flashtune.measure import Outcome
from flashtune.problem import Bucket
from flashtune.replay import write_recording
from flashtune.search_plan import plan
from flashtune.search_study import bucket_label
from flashtune.tuned_db import Provenance, Record
from flashtune.tuned_db.io import write_table

H100 = targets.get("H100")
ROOT = Path(__file__).resolve().parents[1]

A, B = "fwd-m64-n64-w4-s3", "fwd-m128-n128-w8-s3"
C = "fwd-m128-n64-w8-s4"            # the sm_90 D=64 default
D = "fwd-m256-n256-w8-s4"           # over the H100's shared memory at D=64: never compiled
# seqlen -> the table's record there, and {variant: (ms, spread) | None (compile error)}
CASES = {
    512: (A, {A: (1.00, 0.01), B: (1.20, 0.0), C: (1.20, 0.0)}),
    1024: (B, {A: (2.00, 0.0), B: (2.20, 0.02), C: (2.00, 0.01)}),   # 10% slower: flagged
    2048: (C, {A: None, B: (3.30, 0.0), C: (3.00, 0.0)}),             # the record is the default
    4096: (B, {A: (4.20, 0.0), B: (4.10, 0.03), C: (4.00, 0.005)}),  # 2.5% slower, within 3%
}


def _script():
    spec = importlib.util.spec_from_file_location("_tuning_value",
                                                  ROOT / "bench" / "tuning_value.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _record(bucket, name):
    prov = Provenance("NVIDIA H100 80GB HBM3", "9.0", 132, "580", "13.0", "2.11", "3.6.0",
                      "0.1.0", "0" * 16, "2026-11-21T00:00:00+00:00", "search")
    return Record("nvidia-h100-80gb-hbm3", bucket, Variant.parse(name), 1.0, 100.0, "TFLOP/s",
                  1e-3, prov)


def _setup(tmp_path, **meta):
    """A table of five fwd D=64 records (one, D's, off the measured grid) and a recording of
    every config in the four buckets with records."""
    planned = {pb.problem.seqlen_q: pb for pb in plan(H100, ("fwd",), ("bfloat16",), (64,),
                                                      (False,), ())}
    recs = [_record(planned[n].bucket, rec) for n, (rec, _) in CASES.items()]
    recs.append(_record(planned[16384].bucket, D))
    table = write_table(tmp_path / "table.json", "H100", recs)
    rows = []
    for n, (_, times) in CASES.items():
        for name, t in times.items():
            o = (Outcome.fail("compile", "out of resources (replayed)") if t is None else
                 Outcome(True, t[0], max_err=1e-3))
            rows.append((planned[n].bucket, name, o, {"spread": t[1]} if t else {}))
    rec = tmp_path / "rec.jsonl"
    write_recording(rec, {"gpu": "H100", "gpu_name": "NVIDIA H100 80GB HBM3", **meta},
                    [planned[n].problem for n in CASES], rows)
    labels = {n: bucket_label(planned[n].bucket) for n in CASES}
    return str(table), str(rec), labels


def _geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def test_summary_matches_the_recording(tmp_path, capsys):
    assert default_variant("fwd", 64, "bfloat16", arch="sm_90").name == C
    table, rec, labels = _setup(tmp_path)
    out = tmp_path / "tv.jsonl"
    seqlens = [a for n in CASES for a in ("--seqlen", str(n))]
    assert _script().main(["--replay", rec, "--table", table, "--out", str(out),
                           "--rounds", "2", *seqlens]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["kind"] == "meta" and lines[0]["table_gpu"] == "nvidia-h100-80gb-hbm3"
    rows = [x for x in lines if x["kind"] == "row"]
    (s,) = [x for x in lines if x["kind"] == "summary"]
    # one row per (bucket, config): A, B, C, D in each of the four buckets; D infeasible
    assert len(rows) == 16
    assert {r["stage"] for r in rows if r["variant"] == D} == {"infeasible"}
    a2048 = next(r for r in rows if r["variant"] == A and r["bucket"] == labels[2048])
    assert not a2048["ok"] and a2048["stage"] == "compile"
    c2048 = next(r for r in rows if r["variant"] == C and r["bucket"] == labels[2048])
    assert sorted(c2048["roles"]) == ["candidate", "default", "tuned"]
    assert s["measured"] == 4 and s["records_off_grid"] == 1
    # the causal buckets of the grid have no record
    assert s["skipped"] == 4 and set(s["skipped_buckets"].values()) == {"no record in the table"}

    ms = {n: {v: t[0] for v, t in times.items() if t} for n, (_, times) in CASES.items()}
    # tuned vs default: default time / tuned time per bucket
    vs_def = {n: ms[n][C] / ms[n][rec_] for n, (rec_, _) in CASES.items()}
    d = s["tuned_vs_default"]
    assert d["geomean"] == pytest.approx(_geomean(vs_def.values()))
    assert d["worst"] == pytest.approx(2.0 / 2.2) and d["worst_bucket"] == labels[1024]
    # slower beyond noise: 1024 only (10% > max(2%, 1%, 1%)); 4096's 2.5% is within its 3%
    (slow,) = s["slower_than_default"]
    assert slow["bucket"] == labels[1024] and slow["noise"] == pytest.approx(0.02)
    assert slow["slowdown"] == pytest.approx(0.1)
    # single best: per bucket time / fastest, a failure (A at 2048) or infeasible (D) charged
    # the bucket's slowest time
    fastest = {n: min(t.values()) for n, t in ms.items()}
    slowest = {n: max(t.values()) for n, t in ms.items()}
    score = {v: _geomean([ms[n].get(v, slowest[n]) / fastest[n] for n in CASES])
             for v in (A, B, C, D)}
    sb = s["single_best"]
    assert sb["variant"] == A == min(score, key=score.get)
    assert sb["score"] == pytest.approx(score[A]) and sb["scores"][D] == pytest.approx(score[D])
    assert sb["failed_in"] == [labels[2048]]
    # tuned vs single best, where both ran (not 2048)
    vs_single = [ms[n][A] / ms[n][CASES[n][0]] for n in (512, 1024, 4096)]
    g = s["tuned_vs_single"]
    assert g["buckets"] == 3 and g["geomean"] == pytest.approx(_geomean(vs_single))
    assert g["worst"] == pytest.approx(2.0 / 2.2) and g["worst_bucket"] == labels[1024]
    printed = capsys.readouterr().out
    assert "slower than the default beyond noise in " + labels[1024] in printed


def test_buckets_without_records_are_skipped(tmp_path):
    table, rec, _ = _setup(tmp_path)
    out = tmp_path / "tv.jsonl"
    assert _script().main(["--replay", rec, "--table", table, "--out", str(out),
                           "--seqlen", "512", "--seqlen", "8192"]) == 0
    (s,) = [json.loads(x) for x in out.read_text().splitlines() if '"summary"' in x]
    # the grid: 512 and 8192, causal and not; only 512 non-causal has a record
    assert s["measured"] == 1 and s["skipped"] == 3
    assert set(s["skipped_buckets"].values()) == {"no record in the table"}


def test_budget_cut_keeps_what_it_measured(tmp_path):
    table, rec, labels = _setup(tmp_path, delay_s=0.2)  # each measurement takes 0.2 s
    out = tmp_path / "tv.jsonl"
    seqlens = [a for n in CASES for a in ("--seqlen", str(n))]
    assert _script().main(["--replay", rec, "--table", table, "--out", str(out),
                           "--budget", "0.3", "--family", "fwd", *seqlens]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    (s,) = [x for x in lines if x["kind"] == "summary"]
    # inline (replayed) measuring finishes the bucket it started; the others are cut
    assert {x["bucket"] for x in lines if x["kind"] == "row"} == {labels[512]}
    assert s["measured"] == 1 and s["tuned_vs_default"]["geomean"] == pytest.approx(1.2)
    cut = [b for b, why in s["skipped_buckets"].items() if why == "cut by --budget"]
    assert sorted(cut) == sorted(labels[n] for n in (1024, 2048, 4096))


def test_against_another_table_times_its_record_beside(tmp_path, capsys):
    """--against: the other table's record of each bucket is timed too, tuned vs it per bucket
    (its time / the tuned time); --no-single leaves the single-best candidates out."""
    table, rec, labels = _setup(tmp_path)
    planned = {pb.problem.seqlen_q: pb for pb in plan(H100, ("fwd",), ("bfloat16",), (64,),
                                                      (False,), ())}
    # the other table: B at 512 (slower than the tuned A), A at 1024 (faster than the tuned B),
    # nothing at 2048, B (the tuned record itself) at 4096
    theirs = {512: B, 1024: A, 4096: B}
    other = write_table(tmp_path / "other.json", "H100",
                        [_record(planned[n].bucket, v) for n, v in theirs.items()])
    out = tmp_path / "tv.jsonl"
    seqlens = [a for n in CASES for a in ("--seqlen", str(n))]
    assert _script().main(["--replay", rec, "--table", table, "--against", str(other),
                           "--no-single", "--out", str(out), *seqlens]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["against"] == str(other) and lines[0]["single"] is False
    rows = [x for x in lines if x["kind"] == "row"]
    assert not any("candidate" in r["roles"] for r in rows)
    assert {r["bucket"] for r in rows if "against" in r["roles"]} == {labels[n] for n in theirs}
    (s,) = [x for x in lines if x["kind"] == "summary"]
    ms = {n: {v: t[0] for v, t in times.items() if t} for n, (_, times) in CASES.items()}
    want = {labels[n]: ms[n][v] / ms[n][CASES[n][0]] for n, v in theirs.items()}
    g = s["tuned_vs_against"]
    assert g["per_bucket"] == pytest.approx(want) and g["buckets"] == 3
    assert g["worst_bucket"] == labels[1024] and g["worst"] == pytest.approx(2.0 / 2.2)
    assert g["per_bucket"][labels[4096]] == pytest.approx(1.0)  # the same variant: itself
    assert "tuned/against" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--family", "nope"], "--family 'nope': unknown kernel family"),
    (["--table", "/nonexistent/t.json"], "--table /nonexistent/t.json: no such file"),
    (["--against", "/nonexistent/a.json"], "--against /nonexistent/a.json: no such file"),
    (["--family", "bwd"], "--family bwd: the table"),
    (["--rounds", "0"], "--rounds 0"),
    (["--seqlen", "-4"], "--seqlen -4: expected a positive integer"),
])
def test_bad_arguments(tmp_path, capsys, args, message):
    table, rec, _ = _setup(tmp_path)
    base = ["--replay", rec, "--out", str(tmp_path / "o.jsonl")]
    if "--table" not in args:
        base += ["--table", table]
    with pytest.raises(SystemExit) as e:
        _script().main(base + args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
