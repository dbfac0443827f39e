"""Shipped tables: format, stable bytes, bad files; the db CLI: show, export -> import, diff."""
import dataclasses
import collections
import json

import pytest
from click.testing import CliRunner

from flashtune._keys import as_dict
from flashtune.cli import main
from flashtune.tuned_db import TableError, TunedDB
from flashtune.tuned_db.io import (SCHEMA, SCHEMA_VERSION, TABLES_DIR, read_header, read_table,
                                   to_json, write_table)

from test_db import H100, make_record


def _recs():
    return [make_record(sq=n, bh=bh, ms=n / 1000) for n in (4096, 512, 1024) for bh in (16, 8)]


def test_table_round_trip_and_stable_bytes(tmp_path):
    recs = _recs()
    path = write_table(tmp_path / "t.json", "H100", recs)
    t = read_table(path)
    assert (t.gpu, t.gpu_name, t.arch) == (H100, "NVIDIA H100 80GB HBM3", "sm_90")
    assert sorted(t.records, key=lambda r: r.key) == sorted(recs, key=lambda r: r.key)
    # same records in any order -> the same bytes; keys sorted, records in bucket order
    assert to_json("H100", list(reversed(recs))) == path.read_text()
    doc = json.loads(path.read_text())
    assert (doc["schema"], doc["schema_version"]) == (SCHEMA, SCHEMA_VERSION)
    assert [r["bucket"]["seqlen_q"] for r in doc["records"]] == [512, 512, 1024, 1024, 4096, 4096]
    assert "gpu" not in doc["records"][0]  # the header says it once
    assert path.read_text().splitlines()[1].startswith('  "arch"')  # indented: diffs read well


def test_shipped_tables_are_valid_and_hold_no_invented_numbers():
    paths = sorted(TABLES_DIR.glob("*.json"))
    assert any(p.stem == H100 for p in paths)
    for p in paths:
        t = read_table(p)  # strict: every record valid
        assert p.stem == t.gpu
        # a bool, not the texts: pytest's diff of two 10k-line tables runs for many minutes
        canonical = p.read_text() == to_json(t.gpu, t.records)
        assert canonical, f"{p.name} is not write_table's bytes: write it with `flashtune db export`"
        assert all(r.provenance.source in ("search", "default") for r in t.records)


@pytest.mark.parametrize("text,match", [
    ("{not json", "corrupt"),
    ('["a list"]', "not a flashtune tuned table"),
    ('{"schema": "other"}', "not a flashtune tuned table"),
    ('{"schema": "flashtune.tuned-table", "schema_version": 99, "gpu": "x", "records": []}',
     "schema version 99"),
    ('{"schema": "flashtune.tuned-table", "schema_version": "1", "gpu": "x", "records": []}',
     "schema version '1'"),
    ('{"schema": "flashtune.tuned-table", "schema_version": 1, "gpu": "x", "records": {}}',
     "'records' must be a list"),
])
def test_bad_table_files_name_the_file(tmp_path, text, match):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(TableError, match=match) as e:
        read_table(p)
    assert str(p) in str(e.value)
    with pytest.raises(TableError):
        read_header(p)


def test_missing_table_names_the_file(tmp_path):
    with pytest.raises(TableError, match=f"{tmp_path}/nope.json: no such file"):
        read_table(tmp_path / "nope.json")


def _write_with_bad_record(path, bad_variant=None, drop_field=None):
    path = write_table(path, "H100", _recs())
    doc = json.loads(path.read_text())
    if bad_variant:
        doc["records"][1]["variant"] = bad_variant
    if drop_field:
        del doc["records"][1][drop_field]
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("bad", [
    {"bad_variant": {"family": "fwd", "block_m": 128, "block_n": 64, "num_warps": 4,
                     "num_stages": 3, "swizzle": 8}},                                  # unknown field
    {"bad_variant": {"family": "decode", "block_m": 128, "block_n": 64, "num_warps": 4,
                     "num_stages": 3}},                                                # unknown family
    {"bad_variant": {"family": "fwd", "block_m": 96, "block_n": 64, "num_warps": 4,
                     "num_stages": 3}},                                                # invalid value
    {"drop_field": "median_ms"},
])
def test_record_the_generator_no_longer_knows(tmp_path, bad):
    p = _write_with_bad_record(tmp_path / "t.json", **bad)
    with pytest.raises(TableError, match=rf"{p}, record 1: "):
        read_table(p)
    t = read_table(p, strict=False)  # lenient (the dispatcher): the rest of the table serves
    assert len(t.records) == 5 and len(t.skipped) == 1 and str(p) in t.skipped[0]


# -- CLI ----------------------------------------------------------------------------------------
def _cli(*args):
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res


def _rows(url):
    """Every column of every row, without the surrogate id: what 'identical rows' means."""
    import sqlalchemy as sa
    engine = sa.create_engine(url)
    with engine.connect() as c:
        rows = [{k: v for k, v in r._mapping.items() if k != "id"}
                for r in c.execute(sa.text("SELECT * FROM tuned_records"))]
    engine.dispose()
    return sorted(rows, key=lambda d: (d["gpu"], d["bucket_key"]))


def test_export_import_gives_identical_rows(tmp_path):
    src, dst = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    recs = _recs() + [make_record(gpu="nvidia-h200", sq=2048)]
    TunedDB(src).put_many(recs)
    out = tmp_path / "h100.json"
    res = _cli("db", "export", "--gpu", "H100", "-o", str(out), "--db", src)
    assert res.exit_code == 0 and "wrote 6 record(s)" in res.output
    res = _cli("db", "import", str(out), "--db", dst)
    assert res.exit_code == 0 and "imported 6 record(s)" in res.output
    assert _rows(dst) == [r for r in _rows(src) if r["gpu"] == H100]
    # exporting the imported DB gives the same bytes
    out2 = tmp_path / "again.json"
    _cli("db", "export", "--gpu", H100, "-o", str(out2), "--db", dst)
    assert out2.read_text() == out.read_text()
    # importing twice changes nothing (upsert)
    _cli("db", "import", str(out), "--db", dst)
    assert len(_rows(dst)) == 6


def test_import_mark_imported_and_bad_file(tmp_path):
    dst = f"sqlite:///{tmp_path / 'b.db'}"
    good = write_table(tmp_path / "good.json", "H100", _recs())
    res = _cli("db", "import", str(good), "--mark-imported", "--db", dst)
    assert res.exit_code == 0
    assert {r.provenance.source for r in TunedDB(dst).records()} == {"import"}
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    res = _cli("db", "import", str(bad), "--db", f"sqlite:///{tmp_path / 'c.db'}")
    assert res.exit_code == 1 and str(bad) in res.output and "corrupt" in res.output


def test_import_keep_faster_merges_only_the_faster_records(tmp_path):
    dst = f"sqlite:///{tmp_path / 'b.db'}"
    TunedDB(dst).put_many([make_record(sq=1024, ms=1.0), make_record(sq=2048, ms=2.0)])
    new = write_table(tmp_path / "new.json", "H100", [
        make_record(sq=1024, ms=1.5, variant="fwd-m64-n64-w4-s2"),   # slower: the DB's stays
        make_record(sq=2048, ms=1.0, variant="fwd-m64-n64-w4-s2"),   # faster: replaces it
        make_record(sq=4096, ms=3.0)])                               # a new bucket: added
    res = _cli("db", "import", str(new), "--keep-faster", "--db", dst)
    assert res.exit_code == 0, res.output
    assert "imported 2 record(s)" in res.output and "kept 1 faster record(s)" in res.output
    got = {r.bucket.seqlen_q: (r.variant.name, r.median_ms) for r in TunedDB(dst).records()}
    assert got == {1024: ("fwd-m128-n64-w4-s3", 1.0), 2048: ("fwd-m64-n64-w4-s2", 1.0),
                   4096: ("fwd-m128-n64-w4-s3", 3.0)}
    # without the flag every record of the file is upserted
    _cli("db", "import", str(new), "--db", dst)
    assert TunedDB(dst).get("H100", make_record(sq=1024).bucket).median_ms == 1.5


def test_import_keep_faster_trusts_the_files_run_where_it_timed_both(tmp_path):
    # a re-search times the table's record beside its own pick: those two numbers come from
    # one run, a record's own median from another session (the H100 kept a 311.0 TFLOP/s
    # record over a pick that had timed it 3% slower in the same run, session 30)
    import dataclasses
    dst = f"sqlite:///{tmp_path / 'b.db'}"
    old = "fwd-m128-n64-w4-s3"  # make_record's variant: the DB's records, from a fast session
    TunedDB(dst).put_many([make_record(sq=1024, ms=1.0), make_record(sq=2048, ms=1.0)])

    def picked(sq, ms, old_ms):  # the file's pick, and the DB's variant timed in its run
        r = make_record(sq=sq, ms=ms, variant="fwd-m64-n64-w4-s2")
        return dataclasses.replace(r, runner_ups=((old, old_ms),) + r.runner_ups)
    new = write_table(tmp_path / "new.json", "H100", [
        picked(1024, 1.05, 1.10),   # slower than the DB's 1.0, faster in its own run: replaces
        picked(2048, 0.95, 0.93)])  # faster than 1.0, slower than the old variant's 0.93: kept
    res = _cli("db", "import", str(new), "--keep-faster", "--db", dst)
    assert res.exit_code == 0, res.output
    assert "imported 1 record(s)" in res.output and "kept 1 faster record(s)" in res.output
    assert "same run: 0.93 ms against 0.95 ms" in res.output
    got = {r.bucket.seqlen_q: (r.variant.name, r.median_ms) for r in TunedDB(dst).records()}
    assert got == {1024: ("fwd-m64-n64-w4-s2", 1.05), 2048: (old, 1.0)}


def test_show_table_and_json(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    TunedDB(url).put_many(_recs())
    none = str(tmp_path / "no-tables")
    res = _cli("db", "show", "--gpu", "H100", "--db", url, "--tables", none)
    assert res.exit_code == 0 and "fwd-m128-n64-w4-s3" in res.output and "6 record(s)" in res.output
    res = _cli("db", "show", "--gpu", "H100", "--format", "json", "--db", url, "--tables", none)
    rows = json.loads(res.output)["records"]
    assert len(rows) == 6 and {(r["level"], r["source"], r["status"]) for r in rows} == {
        ("user-db", url, "serves")}
    res = _cli("db", "show", "--gpu", "H200", "--db", url, "--tables", none)
    assert "0 record(s)" in res.output
    path = write_table(tmp_path / "t.json", "H100", _recs()[:2])
    res = _cli("db", "show", "--table", str(path), "--format", "json")
    assert [r["source"] for r in json.loads(res.output)["records"]] == [str(path)] * 2


@pytest.fixture
def no_user_db(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path / "cache"))
    for knob in ("FLASHTUNE_DB", "FLASHTUNE_GPU"):
        monkeypatch.delenv(knob, raising=False)


def test_show_lists_the_shipped_table_that_serves_the_gpu(no_user_db):
    shipped = TABLES_DIR / f"{H100}.json"
    n = len(read_table(shipped).records)
    res = _cli("db", "show", "--gpu", "H100")
    assert res.exit_code == 0, res.output
    assert f"gpu-table  {shipped}: {n} record(s)" in res.output and f"{n} record(s)" in res.output
    own = [line.split()[:2] for line in res.output.splitlines() if line.startswith("gpu-table ")]
    assert own == [["gpu-table", shipped.name]] * n  # each row names its table
    # then the other shipped tables of its architecture (the H200's), each row with its source
    h200 = TABLES_DIR / "nvidia-h200.json"
    m = len(read_table(h200).records)
    rows = json.loads(_cli("db", "show", "--gpu", "H100", "--format", "json").output)["records"]
    by = collections.Counter((r["level"], r["source"]) for r in rows)
    assert by == {("gpu-table", str(shipped)): n, ("arch-table", str(h200)): m}
    # an H200 is served by its own table first, the H100's after it (same architecture)
    rows = json.loads(_cli("db", "show", "--gpu", "H200", "--format", "json").output)["records"]
    by = collections.Counter((r["level"], r["source"]) for r in rows)
    assert by == {("gpu-table", str(h200)): m, ("arch-table", str(shipped)): n}


def test_show_orders_the_levels_and_marks_what_serves(tmp_path, no_user_db):
    tables = tmp_path / "tables"
    tables.mkdir()
    shipped = write_table(tables / f"{H100}.json", "H100",
                          [make_record(sq=1024), make_record(sq=4096), make_record(sq=8192)])
    url = f"sqlite:///{tmp_path / 'u.db'}"
    old = "0123456789abcdef"  # a template hash the generator no longer has: stale
    TunedDB(url).put_many([make_record(sq=1024, variant="fwd-m64-n64-w4-s2"),   # overrides
                           make_record(sq=4096, thash=old, variant="fwd-m64-n64-w4-s2"),
                           make_record(sq=16384, thash=old)])                   # alone, stale
    res = _cli("db", "show", "--gpu", "H100", "--db", url, "--tables", str(tables),
               "--format", "json")
    got = [(r["level"], r["record"]["bucket"]["seqlen_q"], r["status"])
           for r in json.loads(res.output)["records"]]
    assert got == [("user-db", 1024, "serves"), ("user-db", 4096, "shadowed"),
                   ("user-db", 16384, "shadowed"),  # stale: the fresh 8192 record serves instead
                   ("gpu-table", 1024, "shadowed"), ("gpu-table", 4096, "serves"),
                   ("gpu-table", 8192, "serves")]
    out = _cli("db", "show", "--gpu", "H100", "--db", url, "--tables", str(tables)).output
    assert out.index(f"user-db    {url}") < out.index(f"gpu-table  {shipped}")
    assert "note: measured on fwd-m128-n64-w4-s3 code 0123456789abcdef" in out


def test_show_without_a_gpu_asks_for_one(no_user_db, monkeypatch):
    from flashtune import targets
    monkeypatch.setattr(targets, "detect", lambda *a, **k: None)
    res = _cli("db", "show")
    assert res.exit_code == 2 and "no GPU detected" in res.output and "--gpu" in res.output
    monkeypatch.setenv("FLASHTUNE_GPU", "H100")  # the dispatcher's knob names the GPU too
    res = _cli("db", "show", "--format", "json")
    assert res.exit_code == 0 and json.loads(res.output)["gpu"] == H100


def test_show_unreachable_db_is_a_clear_error():
    res = _cli("db", "show", "--gpu", "H100",
               "--db", "postgresql+psycopg://u:secret@127.0.0.1:1/nowhere")
    assert res.exit_code == 1 and "127.0.0.1:1/nowhere" in res.output
    assert "secret" not in res.output and "Traceback" not in res.output


def test_export_with_nothing_tuned_fails_and_writes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    TunedDB(url).put_many(_recs())  # H100 records only
    out = tmp_path / "a100.json"
    res = _cli("db", "export", "--gpu", "A100", "-o", str(out), "--db", url)
    assert res.exit_code == 1 and not out.exists()
    assert "no records of nvidia-a100" in res.output and "nothing to export" in res.output


def test_diff(tmp_path):
    old = _recs()
    new = list(old)
    new[0] = dataclasses.replace(old[0], variant=old[0].variant.__class__.parse(
        "fwd-m64-n64-w4-s2"), median_ms=old[0].median_ms * 0.8)   # changed: 20% faster
    removed = new.pop(3)
    added = make_record(sq=16384, bh=1)
    new.append(added)
    a = write_table(tmp_path / "a.json", "H100", old)
    b = write_table(tmp_path / "b.json", "H100", new)
    res = _cli("db", "diff", str(a), str(b))
    assert res.exit_code == 0
    assert "1 added, 1 removed, 1 changed" in res.output
    assert "fwd-m128-n64-w4-s3 -> fwd-m64-n64-w4-s2" in res.output and "(-20.0%)" in res.output
    changes = json.loads(_cli("db", "diff", str(a), str(b), "--format", "json").output)
    kinds = {c["kind"]: c for c in changes}
    assert set(kinds) == {"added", "removed", "changed"}
    assert kinds["changed"]["time_ratio"] == pytest.approx(0.8)
    assert kinds["removed"]["old"]["bucket"] == as_dict(removed.bucket)  # Bucket.mask left out at ""
    assert kinds["added"]["new"]["bucket"]["seqlen_q"] == 16384
    # a table against a DB URL; identical -> nothing changed
    url = f"sqlite:///{tmp_path / 'x.db'}"
    TunedDB(url).put_many(old)
    assert "0 added, 0 removed, 0 changed" in _cli("db", "diff", str(a), url).output


def test_a_template_edit_that_leaves_a_variants_code_alone_keeps_its_record_fresh(monkeypatch):
    # staleness follows the code a variant runs (codegen.kernel_hash), not the template file:
    # an added comment or a branch other variants take changes the file hash only
    import importlib

    from flashtune.codegen import Variant
    from flashtune.tuned_db import lookup
    render_mod = importlib.import_module("flashtune.codegen.render")  # the module, not render()
    v = Variant.parse("fwd-m128-n64-w4-s3")
    rec = make_record(variant=v.name)
    assert lookup.staleness(rec) == ()
    text = render_mod.template_text("fwd")
    edited = text.replace("import triton\n", "import triton\n# a new comment\n#%if loads == 'x'\n"
                          "BOGUS = 1\n#%endif\n", 1)
    for fn in (render_mod.template_text, render_mod.template_hash, render_mod.kernel_hash,
               lookup._current_kernel_hash):
        fn.cache_clear()
    monkeypatch.setattr(render_mod, "template_text", lambda family: edited if family == "fwd"
                        else text)
    try:
        assert render_mod.kernel_hash(v) == rec.provenance.template_hash
        assert lookup.staleness(rec) == ()
        # and a change to the code it runs makes it stale
        monkeypatch.setattr(render_mod, "template_text",
                            lambda family: text.replace("qk_scale = sm_scale * 1.44",
                                                        "qk_scale = sm_scale * 1.45"))
        render_mod.kernel_hash.cache_clear()
        lookup._current_kernel_hash.cache_clear()
        assert lookup.staleness(rec) and "kernel changed" in lookup.staleness(rec)[0]
    finally:
        monkeypatch.undo()  # the real template first, then forget everything derived from the
        for fn in (render_mod.template_text, render_mod.template_hash,  # edited one (study
                   render_mod.kernel_hash, lookup._current_kernel_hash):  # names hash it)
            fn.cache_clear()


def test_the_shipped_h100_table_is_fresh():
    # every family's grid, searched 2026-11-24 (D=64/128: 24 fwd, 24 bwd, 64 splitkv, 24
    # hopper_fwd, 24 hopper_bwd, docs/benchmarks.md session 9; D=256: 12 each of fwd, bwd,
    # hopper_fwd, hopper_bwd, session 10; hopper_fwd N <= 2048 partly re-searched in session 11,
    # the causal hopper_fwd buckets with l2_order in session 12);
    # a template change to that code must show up here
    from flashtune.tuned_db import lookup
    from flashtune.tuned_db.io import TABLES_DIR, read_table
    recs = read_table(TABLES_DIR / "nvidia-h100-80gb-hbm3.json").records
    fams = collections.Counter(r.bucket.family for r in recs if not r.bucket.mask)
    assert fams == {"fwd": 36, "bwd": 36, "splitkv": 64, "hopper_fwd": 36, "hopper_bwd": 36}
    # and the bench's masked buckets (D=128, N=4k/16k: the causal 256-key window, the block mask
    # of density ~1/4), searched 2026-11-25 (session 11, before hopper_bwd had a block_sparse
    # render),
    # and the causal 1024- and 4096-key windows at 16k for every family (session 12),
    # and at 4k the 30% and 100% block masks (block16, block64) for every family but the bwd's
    # block64 (session 15: its atomic winner at BH 64 made the bench's B=1 call 20% slower than
    # the dense record's variant, which serves it again),
    # and the bench's own 10% block mask at 4k (block8, B*H = 16) for the bwd (session 16; its
    # fwd and hopper_fwd records left out: at the same shape they outranked the Hopper heuristic
    # for the 30% mask too, whose forward took 0.114 ms through them against 0.097),
    # and the bench's softcap buckets for hopper_bwd (session 24, with dq="gluon") and the bwd
    # (so the two compete on the bucket's own records, not the bwd's dense ones)
    masked = collections.Counter((r.bucket.family, r.bucket.mask) for r in recs if r.bucket.mask)
    wide = {(f, f"window{w}"): 1 for f in ("fwd", "bwd", "hopper_fwd", "hopper_bwd")
            for w in (1024, 4096)}
    dense4k = {(f, "block64"): 1 for f in ("fwd", "hopper_fwd", "hopper_bwd")}
    assert masked == {("fwd", "window256"): 2, ("fwd", "block16"): 2, ("bwd", "window256"): 2,
                      ("bwd", "block16"): 2, ("hopper_fwd", "window256"): 2,
                      ("hopper_fwd", "block16"): 2, ("hopper_bwd", "window256"): 2,
                      ("hopper_bwd", "block16"): 1, **wide, **dense4k,
                      ("bwd", "block8"): 1, ("hopper_bwd", "softcap"): 2,
                      ("bwd", "softcap"): 2}
    assert all(lookup.staleness(r) == () for r in recs)
