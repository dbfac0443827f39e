"""The dispatcher: lookup order, nearest bucket, stale entries, memo, forcing, explain, bad input."""
import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import flashtune
from flashtune import dispatch
from flashtune.cli import main
from flashtune.codegen import Variant
from flashtune.defaults import default_variant
from flashtune.problem import Bucket, Problem
from flashtune.tuned_db import TunedDB
from flashtune.tuned_db.io import table_path, write_table

from test_db import H100, make_record

H200 = "nvidia-h200"
A100 = "nvidia-a100-sxm4-80gb"
V_TABLE, V_ARCH, V_USER = "fwd-m64-n32-w4-s2", "fwd-m32-n32-w4-s1", "fwd-m16-n16-w2-s1"


def prob(nq=1024, nk=None, b=1, h=16, d=128, causal=True, dtype="float16"):
    return Problem("fwd", dtype, d, causal, 1, b, h, nq, nk or nq)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """An empty tables folder and cache folder; the dispatcher assumes an H200."""
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path / "cache"))
    for knob in ("FLASHTUNE_DB", "FLASHTUNE_GPU", "FLASHTUNE_FORCE_VARIANT"):
        monkeypatch.delenv(knob, raising=False)
    d = tmp_path / "tables"
    d.mkdir()
    dispatch.configure(gpu="H200", tables_dir=d)
    yield d
    dispatch.configure()


def ship(d, gpu, *recs):
    return write_table(table_path(gpu, d), gpu, [dataclasses.replace(r, gpu=table_path(gpu).stem)
                                                 for r in recs])


def user_db(monkeypatch, tmp_path, *recs):
    url = f"sqlite:///{tmp_path / 'user.db'}"
    monkeypatch.setenv("FLASHTUNE_DB", url)
    TunedDB(url).put_many(recs)
    dispatch.clear_cache()
    return url


# -- the lookup order ---------------------------------------------------------------------------
def test_default_when_nothing_is_tuned(tables):
    ex = dispatch.explain(prob())
    assert ex.level == "default" and ex.record is None and ex.gpu == H200
    assert ex.variant == default_variant("fwd", 128, "float16", arch="sm_90") == dispatch.select(prob())
    assert any("no shipped table" in n for n in ex.notes)


def test_default_follows_the_dispatch_gpus_arch(tables):
    dispatch.configure(gpu="A100", tables_dir=tables)
    v = dispatch.select(prob())  # sm_80: no TMA, so no descriptor loads
    assert v == default_variant("fwd", 128, "float16", arch="sm_80") and v.loads == "pointer"


def test_gpu_table_serves_its_bucket(tables):
    path = ship(tables, H200, make_record(variant=V_TABLE))
    ex = dispatch.explain(prob())
    assert (ex.level, ex.origin, ex.distance) == ("gpu-table", str(path), 0)
    assert ex.record.bucket == Bucket.of(prob()) and ex.variant.name == V_TABLE
    assert dispatch.select(prob()).name == V_TABLE


def test_same_arch_table_serves_when_the_gpu_has_none(tables):
    ship(tables, A100, make_record(variant=V_USER))      # sm_80: never used for an H200
    path = ship(tables, H100, make_record(variant=V_ARCH))
    ex = dispatch.explain(prob())
    assert (ex.level, ex.origin, ex.variant.name) == ("arch-table", str(path), V_ARCH)
    dispatch.configure(gpu="L40S", tables_dir=tables)   # sm_89: no table of its architecture
    assert dispatch.explain(prob()).level == "default"


def test_user_db_comes_first(tables, tmp_path, monkeypatch):
    ship(tables, H200, make_record(variant=V_TABLE))
    url = user_db(monkeypatch, tmp_path, make_record(gpu=H200, variant=V_USER),
                  make_record(gpu=H100, sq=4096, variant=V_ARCH))  # other GPU: not used
    ex = dispatch.explain(prob())
    assert (ex.level, ex.origin, ex.variant.name) == ("user-db", url, V_USER)
    ex = dispatch.explain(prob(nq=4096))  # the user DB's H100 record is another GPU's
    assert (ex.variant.name, ex.record.gpu) == (V_USER, H200)


def test_default_user_db_file_is_read_when_it_exists(tables):
    TunedDB().put(make_record(gpu=H200, variant=V_USER))  # FLASHTUNE_DB unset: the cache file
    assert dispatch.explain(prob()).level == "user-db"


def test_every_level_in_turn(tables, tmp_path, monkeypatch):
    url = user_db(monkeypatch, tmp_path, make_record(gpu=H200, variant=V_USER))
    ship(tables, H200, make_record(variant=V_TABLE))
    ship(tables, H100, make_record(variant=V_ARCH))
    seen = [dispatch.explain(prob()).level]
    TunedDB(url).delete(H200, Bucket.of(prob()))  # a write in this process drops the memo
    seen.append(dispatch.explain(prob()).level)
    table_path(H200, tables).unlink()
    dispatch.clear_cache()
    seen.append(dispatch.explain(prob()).level)
    table_path(H100, tables).unlink()
    dispatch.clear_cache()
    seen.append(dispatch.explain(prob()).level)
    assert seen == ["user-db", "gpu-table", "arch-table", "default"]


# -- nearest bucket -----------------------------------------------------------------------------
def test_builtin_defaults_switch_skips_every_tuned_level(tables, tmp_path, monkeypatch):
    ship(tables, H200, make_record(variant=V_TABLE))
    user_db(monkeypatch, tmp_path, make_record(gpu=H200, variant=V_USER))
    assert dispatch.select(prob()).name == V_USER
    with dispatch.builtin_defaults():
        ex = dispatch.explain(prob())
        assert ex.level == "default" and ex.gpu == H200
        assert ex.variant == default_variant("fwd", 128, "float16", arch="sm_90")
        assert dispatch.select(prob()) == ex.variant
    # back to the tuned levels, with the other overrides (this GPU, these tables) kept
    assert dispatch.select(prob()).name == V_USER


def test_missing_bucket_takes_the_nearest_by_log_distance(tables):
    ship(tables, H200, make_record(sq=512, variant=V_TABLE), make_record(sq=8192, variant=V_ARCH))
    ex = dispatch.explain(prob(nq=1000))  # bucket 1024: 512 is 2 octaves away, 8192 is 6
    assert ex.record.bucket.seqlen_q == 512 and ex.distance == 2 and ex.variant.name == V_TABLE
    assert dispatch.explain(prob(nq=5000)).record.bucket.seqlen_q == 8192
    assert "nearest bucket" in str(ex) and "2 octaves" in str(ex)



def test_a_window_takes_the_dense_record_where_it_is_nearer(tables):
    """A window of 4096 keys a query (causal, 16k: 1 octave from the dense problem's 8192) is
    served by the dense causal record, not by a 256-key window's record 4 octaves away (its
    small tiles ran a wide window's backward at 0.87x Flex on the H100); a 512-key window takes
    the 256-key window's record."""
    dense = make_record(sq=16384, variant=V_TABLE)
    win = make_record(sq=16384, variant="fwd-m16-n16-w2-s1-window=true")
    win = dataclasses.replace(win, bucket=dataclasses.replace(win.bucket, mask="window256"))
    ship(tables, H200, dense, win)
    base = prob(nq=16384)
    ex = dispatch.explain(dataclasses.replace(base, window=4096))
    assert ex.record.bucket.mask == "" and ex.distance == 1
    assert ex.variant.name == V_TABLE + "-window=true"
    ex = dispatch.explain(dataclasses.replace(base, window=512))
    assert ex.record.bucket.mask == "window256" and ex.distance == 1
    assert dispatch.explain(base).record.bucket.mask == ""   # never the reverse

def test_nearest_never_crosses_dtype_head_dim_or_causality(tables):
    ship(tables, H200, make_record(dtype="bfloat16"), make_record(d=64), make_record(causal=False))
    assert dispatch.explain(prob()).level == "default"
    assert dispatch.explain(prob(d=96)).level == "default"   # pads to 128: no 128 record
    assert dispatch.explain(prob(d=48)).record.bucket.head_dim == 64  # pads to 64


def test_exact_bucket_beats_a_nearer_level_and_ties_go_to_the_higher_level(tables, tmp_path,
                                                                          monkeypatch):
    ship(tables, H200, make_record(sq=1024, variant=V_TABLE), make_record(sq=4096, variant=V_TABLE))
    user_db(monkeypatch, tmp_path, make_record(gpu=H200, sq=256, variant=V_USER),
            make_record(gpu=H200, sq=4096, variant=V_USER))
    assert dispatch.explain(prob(nq=1024)).level == "gpu-table"   # exact vs 4 octaves away
    assert dispatch.explain(prob(nq=4096)).level == "user-db"     # both exact: user DB wins


# -- stale entries ------------------------------------------------------------------------------
def test_stale_entries_are_demoted_behind_any_fresh_one(tables):
    ship(tables, H200, make_record(sq=1024, thash="0123456789abcdef", variant=V_USER),
         make_record(sq=8192, variant=V_TABLE))
    ex = dispatch.explain(prob())
    assert ex.variant.name == V_TABLE and ex.distance == 6 and not ex.stale


def test_stale_entry_serves_alone_with_a_one_time_warning(tables, caplog):
    # a changed template is stale: the generator no longer emits the kernel that was timed
    ship(tables, H200, make_record(thash="0123456789abcdef", variant=V_USER))
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        ex = dispatch.explain(prob())
        for n in (1024, 1000, 1100):
            dispatch.select(prob(nq=n))
    assert ex.level == "gpu-table" and ex.variant.name == V_USER and ex.distance == 0
    assert len(ex.stale) == 1 and "code 0123456789abcdef" in ex.stale[0]
    warnings = [r.message for r in caplog.records if "stale" in r.message]
    assert len(warnings) == 1 and "flashtune search" in warnings[0]
    assert f"stale    measured on {V_USER} code 0123456789abcdef" in str(ex)


def test_other_triton_minor_serves_as_fresh_with_a_note_and_no_warning(tables, caplog):
    import triton
    major, minor = map(int, triton.__version__.split(".")[:2])
    other = f"{major}.{minor + 1}.0"
    # a fresh record 6 octaves away would beat a stale exact one: it must not here
    ship(tables, H200, make_record(triton=other, variant=V_USER),
         make_record(sq=65536, variant=V_TABLE))
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        ex = dispatch.explain(prob())
        dispatch.select(prob())
    assert ex.variant.name == V_USER and ex.distance == 0 and ex.stale == ()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    note = f"measured with triton {major}.{minor + 1}, running {major}.{minor}: timings may differ"
    assert any(n.startswith(note) for n in ex.notes) and f"note     {note}" in str(ex)
    assert note in json.dumps(ex.to_dict())
    assert not any("measured with" in n for n in dispatch.explain(prob(nq=65536)).notes)


def test_other_triton_patch_release_is_not_even_a_note(tables):
    import triton
    major, minor = triton.__version__.split(".")[:2]
    ship(tables, H200, make_record(triton=f"{major}.{minor}.99", variant=V_TABLE))
    ex = dispatch.explain(prob())
    assert ex.stale == () and not any("measured with" in n for n in ex.notes)


# -- memo ---------------------------------------------------------------------------------------
def test_no_db_or_table_access_after_the_first_call(tables, tmp_path, monkeypatch):
    from flashtune.tuned_db import lookup
    user_db(monkeypatch, tmp_path, make_record(gpu=H200, variant=V_USER))
    ship(tables, H200, make_record(sq=4096, variant=V_TABLE))
    calls = {"db": 0, "table": 0, "best": 0}
    for name, key in (("user_db", "db"), ("gpu_table", "table"), ("best", "best")):
        real = getattr(lookup, name)
        monkeypatch.setattr(lookup, name,
                            lambda *a, _r=real, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1),
                                                               _r(*a, **kw))[1])
    for _ in range(100):
        assert dispatch.select(prob()).name == V_USER
        assert dispatch.select(prob(nq=1000)).name == V_USER  # same bucket: no new lookup
        assert dispatch.select(prob(nq=4096)).name == V_TABLE
    # one lookup per bucket and per family that can serve it (splitkv competes for fwd calls;
    # hopper_fwd too where it can run: not in Triton's interpreter)
    from flashtune.families import all_families
    serving = 1 + sum("fwd" in f.serves and not f.cannot_run(prob(), "sm_90")
                      for f in all_families())
    assert calls == {"db": 1, "table": 1, "best": 2 * serving}
    dispatch.clear_cache()
    dispatch.select(prob())
    assert calls == {"db": 2, "table": 2, "best": 3 * serving}


def test_memo_is_bounded(tables, monkeypatch):
    monkeypatch.setattr(dispatch, "_MEMO_MAX", 4)
    for n in range(1, 20):
        dispatch.select(prob(nq=n))
    assert len(dispatch._memo) <= 4


def test_writes_in_this_process_refresh_the_dispatcher(tables, tmp_path, monkeypatch):
    url = user_db(monkeypatch, tmp_path)
    assert dispatch.select(prob()) == default_variant("fwd", 128, "float16", arch="sm_90")
    TunedDB(url).put(make_record(gpu=H200, variant=V_USER))
    assert dispatch.select(prob()).name == V_USER
    path = ship(tables, H200, make_record(sq=2048, variant=V_TABLE))
    CliRunner().invoke(main, ["db", "import", str(path), "--db", url])
    assert dispatch.select(prob(nq=2048)).name == V_TABLE


def test_attention_creates_no_db_and_loads_no_sqlalchemy(tmp_path):
    # a fresh interpreter: importing flashtune and calling attention must not touch SQLAlchemy
    code = ("import sys, torch, flashtune\n"
            "q = torch.randn(1, 1, 16, 32, dtype=torch.float16)\n"
            "flashtune.attention(q, q, q)\n"
            "assert 'sqlalchemy' not in sys.modules, 'sqlalchemy imported'\n")
    envv = {k: v for k, v in os.environ.items() if k not in ("FLASHTUNE_DB", "FLASHTUNE_GPU")}
    envv.update(FLASHTUNE_CACHE_DIR=str(tmp_path / "cache"), TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", code], env=envv, check=True, timeout=120)
    assert not (tmp_path / "cache" / "tuned.db").exists()


# -- forcing and explain ------------------------------------------------------------------------
def test_force_context_manager_and_env_knob(tables, monkeypatch):
    ship(tables, H200, make_record(variant=V_TABLE))
    with flashtune.force(V_USER) as v:
        assert dispatch.select(prob()) == v == Variant.parse(V_USER)
        ex = dispatch.explain(prob())
        assert (ex.level, ex.origin) == ("forced", "force()")
    assert dispatch.select(prob()).name == V_TABLE  # the memo is untouched by forcing
    monkeypatch.setenv("FLASHTUNE_FORCE_VARIANT", V_ARCH)
    assert dispatch.select(prob()).name == V_ARCH
    assert dispatch.explain(prob()).origin == "FLASHTUNE_FORCE_VARIANT"
    monkeypatch.setenv("FLASHTUNE_FORCE_VARIANT", "bwd-m64-n64-w4-s2-dq=atomic")
    assert dispatch.select(prob()).name == V_TABLE  # another family: not forced


def test_explain_from_tensors(tables):
    ship(tables, H200, make_record(d=64, sq=64, sk=128, bh=2, variant=V_TABLE))
    q = torch.randn(1, 2, 70, 64, dtype=torch.float16)
    k = torch.randn(1, 1, 120, 64, dtype=torch.float16)
    ex = flashtune.explain(q, k, k, causal=True)
    assert ex.problem == Problem("fwd", "float16", 64, True, 2, 1, 2, 70, 120)
    assert ex.bucket == Bucket("fwd", "float16", 64, True, True, 64, 128, 2)
    assert ex.level == "gpu-table" and ex.distance == 0.5  # gqa differs from the record's
    d = ex.to_dict()
    assert json.loads(json.dumps(d))["level"] == "gpu-table" and d["record"]["source"] == "search"


def test_cli_dispatch_explain(tables):
    ship(tables, H100, make_record(variant=V_ARCH))
    args = ["dispatch", "explain", "--gpu", "H200", "--tables", str(tables), "--causal",
            "--head-dim", "128", "--seqlen-q", "1024", "--heads", "16"]
    res = CliRunner().invoke(main, args + ["--format", "json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert (d["level"], d["variant"], d["gpu"]) == ("arch-table", V_ARCH, H200)
    res = CliRunner().invoke(main, args)
    assert "level    arch-table" in res.output and "exact bucket" in res.output


def test_cli_dispatch_explain_shares_dtype_names_and_head_dim_bounds_with_the_rest(tables):
    from flashtune.validate import check_qkv
    base = ["dispatch", "explain", "--gpu", "H200", "--tables", str(tables), "--format", "json"]
    for spelling in ("bf16", "bfloat16", "BF16"):  # what `search --dtype` accepts
        res = CliRunner().invoke(main, base + ["--dtype", spelling])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["bucket"]["dtype"] == "bfloat16"
    q = torch.empty(1, 1, 4, 300, dtype=torch.float16)
    with pytest.raises(ValueError) as api:
        check_qkv(q, q, q, False, None)
    res = CliRunner().invoke(main, base + ["--head-dim", "300"])
    assert res.exit_code == 2 and "--head-dim" in res.output and str(api.value) in res.output


# -- bad input: logged fallbacks, never a crash inside attention ----------------------------------
def _attention_runs():
    q = torch.randn(1, 2, 20, 64, dtype=torch.float16)
    out = flashtune.attention(q, q, q, causal=True)
    ref = flashtune.reference(q, q, q, causal=True)
    assert (out.float() - ref.float()).abs().max() < 1e-2


@pytest.mark.parametrize("text,match", [("{corrupt", "corrupt"),
                                        ('{"schema": "flashtune.tuned-table", "schema_version": 7,'
                                         ' "gpu": "nvidia-h200", "records": []}', "schema version 7")])
def test_bad_gpu_table_falls_back_to_the_next_level(tables, caplog, text, match):
    ship(tables, H100, make_record(d=64, sq=16, bh=2, variant=V_ARCH))
    table_path(H200, tables).write_text(text)
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        ex = dispatch.explain(prob(d=64, nq=20, h=2))
        _attention_runs()
    assert ex.level == "arch-table"
    logged = [r.message for r in caplog.records if match in r.message]
    assert len(logged) == 1 and str(table_path(H200, tables)) in logged[0]


def test_unreachable_db_url_falls_back_to_the_tables(tables, caplog, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_DB", "postgresql+psycopg://u:pw@127.0.0.1:1/nowhere")
    ship(tables, H200, make_record(variant=V_TABLE))
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        ex = dispatch.explain(prob())
        _attention_runs()
    assert ex.level == "gpu-table"
    assert any("127.0.0.1:1/nowhere" in r.message for r in caplog.records)


def test_records_the_generator_no_longer_knows_are_skipped(tables, tmp_path, monkeypatch, caplog):
    import sqlalchemy as sa
    url = user_db(monkeypatch, tmp_path, make_record(gpu=H200, variant=V_USER))
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE tuned_records SET variant = '{\"family\": \"fwd\", \"tiles\": 3}'"))
    engine.dispose()
    path = ship(tables, H200, make_record(variant=V_TABLE), make_record(sq=64, variant=V_TABLE))
    doc = json.loads(path.read_text())
    doc["records"][0]["variant"]["block_m"] = 96  # not a power of two: the generator refuses
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        ex = dispatch.explain(prob())
        _attention_runs()
    assert ex.level == "gpu-table" and ex.variant.name == V_TABLE
    assert any("tiles" in r.message for r in caplog.records)                # the DB row
    assert any(f"{path}, record 0" in r.message for r in caplog.records)    # the table record


def test_torch_compile_sees_the_dispatched_call(tables):
    ship(tables, H200, make_record(d=64, sq=16, bh=2, variant=V_TABLE))
    q = torch.randn(1, 2, 20, 64, dtype=torch.float16)
    fn = torch.compile(lambda q: flashtune.attention(q, q, q, causal=True), backend="eager")
    torch.testing.assert_close(fn(q), flashtune.attention(q, q, q, causal=True), rtol=0, atol=0)


def test_bad_forced_variant_names_the_knob(tables, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_FORCE_VARIANT", "fwd-m100")
    with pytest.raises(ValueError, match="FLASHTUNE_FORCE_VARIANT='fwd-m100'"):
        dispatch.select(prob())


def test_launch_plans_follow_the_tuned_db(tables, tmp_path, monkeypatch):
    # attention memoizes a launch plan per call signature; a record written in this process
    # must still change what the next identical call runs
    from flashtune import ops
    url = user_db(monkeypatch, tmp_path)
    q = torch.randn(1, 16, 1024, 128, dtype=torch.float16)
    k, v = q[:, :, :40], q[:, :, 40:80]

    def ran():
        # keys: (device, dtype, q shape, q strides, k shape, ...)
        plans = [p for key, p in ops._plans.items() if key[2] == q.shape and key[4] == k.shape]
        assert len(plans) == 1
        return plans[0].variant.name

    flashtune.attention(q, k, v, causal=True)
    assert ran() == default_variant("fwd", 128, "float16", arch="sm_90").name
    TunedDB(url).put(make_record(gpu=H200, variant=V_USER, sk=64))
    assert not ops._plans  # the write cleared them
    flashtune.attention(q, k, v, causal=True)
    assert ran() == V_USER


def test_splitkv_record_from_another_bucket_keeps_its_parallelism(tables, monkeypatch):
    # a record serving a neighbour bucket keeps its tile and the programs it was tuned with
    # (num_splits x batch x kv heads), but never fewer splits than the one-wave rule: on the
    # H100 a 2k-key record's 32 splits ran at 0.56x cuDNN at 16k keys (the rule gives 132 there),
    # and a record's 8 splits cut to the rule's 2 ran its one-stage tile at 0.60x
    from flashtune import launch_splitkv
    monkeypatch.setattr(launch_splitkv, "CPU_SMS", 132)  # an H100's SMs, GPU or not
    records = {"splitkv-m16-n64-w2-s1-sp32": (8, 2048, 1),
               "splitkv-m16-n64-w2-s1-sp8": (4, 32768, 64)}
    ship(tables, H200, *(make_record(variant=name, family="splitkv", dtype="bfloat16", d=128,
                                     causal=False, gqa=True, sq=sq, sk=sk, bh=bh)
                         for name, (sq, sk, bh) in records.items()))
    dispatch.clear_cache()

    def decode(hq, hk, b, nk):
        return dispatch.explain(Problem("splitkv", "bfloat16", 128, False, hq // hk, b, hq, 1, nk))
    own = decode(8, 1, 1, 2048)
    assert own.distance == 0 and own.variant.name == "splitkv-m16-n64-w2-s1-sp32"
    far = decode(8, 1, 1, 16384)  # MQA B=1: the wave rule's 132 beat the record's 32
    assert far.distance > 0 and far.record.variant.name == "splitkv-m16-n64-w2-s1-sp32"
    assert far.variant.num_splits == 0 and far.variant.block_n == 64
    assert any("num_splits 32 -> 0 (auto)" in n for n in far.notes)
    near = decode(32, 8, 8, 16384)  # B=8 GQA: the record's 8 splits x 64 programs stay
    assert near.record.variant.name == "splitkv-m16-n64-w2-s1-sp8"
    assert near.variant.num_splits == 8 and near.distance > 0
    wider = decode(32, 8, 32, 32768)  # 4x the batch: the same 512 programs, 2 splits each
    assert wider.record.variant.name == "splitkv-m16-n64-w2-s1-sp8"
    assert wider.variant.num_splits == 2
    assert any("num_splits 8 -> 2" in n for n in wider.notes)
    widest = decode(32, 8, 64, 32768)  # 8x: one split, as the rule gives
    assert widest.variant.num_splits == 0


@pytest.mark.parametrize("faster", ["hopper_bwd", "bwd"])
def test_a_gqa_call_lets_records_of_its_shape_without_gqa_compete(tables, monkeypatch, faster):
    """The tables tune heads that are not shared: a GQA backward (Llama's 4:1) finds each
    family's record on its shape without GQA, and those compete (dispatch._comparable) -- the
    rival's heuristic alone gave every such call to the generic kernels. A family whose record
    is the GQA bucket's own does not compete with the other's non-GQA one: not alike."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    gqa = Problem("bwd", "bfloat16", 128, True, 4, 8, 16, 2048, 2048)
    ms = (0.5, 1.0) if faster == "hopper_bwd" else (1.0, 0.5)
    recs = [make_record(gpu=H200, sq=2048, bh=128, dtype="bfloat16", family="hopper_bwd",
                        variant="hopper_bwd-m64-n64-w4-s2-dq=gluon", ms=ms[0]),
            make_record(gpu=H200, sq=2048, bh=128, dtype="bfloat16", family="bwd",
                        variant="bwd-m64-n128-w8-s2-dq=fused", ms=ms[1])]
    ship(tables, H200, *recs)
    dispatch.clear_cache()
    ex = flashtune.explain(gqa)
    assert ex.variant.family == faster and any("competed" in n and "tuned records" in n
                                               for n in ex.notes), str(ex)
    # the generic family with a record of the GQA bucket itself: no comparison, its own wins
    own = make_record(gpu=H200, sq=2048, bh=128, dtype="bfloat16", family="bwd", gqa=True,
                      variant="bwd-m64-n64-w4-s2-dq=atomic", ms=2.0)
    ship(tables, H200, *recs, own)
    dispatch.clear_cache()
    ex = flashtune.explain(gqa)
    assert ex.variant.name == "bwd-m64-n64-w4-s2-dq=atomic" and not any("competed" in n
                                                               for n in ex.notes), str(ex)


def test_families_compete_on_one_runs_times_where_a_search_timed_both(tables, monkeypatch):
    """A search re-times the other families' records of its bucket beside its pick
    (search.rival_variants) and keeps their times as runner-ups: the dispatcher then decides
    on that run's pair, not on two records' medians from different runs (session 32: D=64
    causal 8k ran the generic fwd on a 3% lead between records of two sessions)."""
    import dataclasses
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    p = Problem("fwd", "bfloat16", 64, True, 1, 2, 32, 8192, 8192)
    hop_name = "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"
    generic = make_record(gpu=H200, sq=8192, bh=32, d=64, dtype="bfloat16", family="fwd",
                          variant="fwd-m64-n64-w4-s3", ms=1.24)
    hopper = make_record(gpu=H200, sq=8192, bh=32, d=64, dtype="bfloat16", family="hopper_fwd",
                         variant=hop_name, ms=1.28)
    # medians of two runs: the generic record's is lower
    ship(tables, H200, dataclasses.replace(generic, runner_ups=()),
         dataclasses.replace(hopper, runner_ups=()))
    dispatch.clear_cache()
    ex = flashtune.explain(p)
    assert ex.variant.family == "fwd" and any("tuned records" in n for n in ex.notes), str(ex)
    # the hopper search's run timed the generic record's variant too, slower than its pick
    ship(tables, H200, dataclasses.replace(generic, runner_ups=()),
         dataclasses.replace(hopper, runner_ups=(("fwd-m64-n64-w4-s3", 1.31),)))
    dispatch.clear_cache()
    ex = flashtune.explain(p)
    assert ex.variant.name == hop_name, str(ex)
    assert any("timed in one run" in n and "1.31 ms" in n for n in ex.notes), str(ex)
    # two runs that timed both: the newer one's pair decides
    newer = dataclasses.replace(generic.provenance, date="2026-11-28T00:00:00+00:00")
    ship(tables, H200, dataclasses.replace(generic, provenance=newer,
                                           runner_ups=((hop_name, 1.30),)),
         dataclasses.replace(hopper, runner_ups=(("fwd-m64-n64-w4-s3", 1.31),)))
    dispatch.clear_cache()
    ex = flashtune.explain(p)
    assert ex.variant.family == "fwd" and any("timed in one run, 2026-11-28" in n
                                              for n in ex.notes), str(ex)
    assert dispatch.same_run(dataclasses.replace(generic, runner_ups=()),
                             dataclasses.replace(hopper, runner_ups=())) is None
