"""The built-in defaults compile for Hopper (sm_90) and fit its shared memory -- checked without
a GPU, so CI catches a template Triton cannot build before GPU time is spent. It runs
`flashtune kernels check` in its own process: Triton fixes interpreter mode at import, and this
test process imported it in interpreter mode. (CI has one Triton version; the GPU machine's may
differ, and bench/device_run.sh runs the GPU tests there.)"""
import json
import os
import re
import subprocess
import sys

import pytest


def kernels_check(*args):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "flashtune.cli", "kernels", "check", *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("dtype,dims", [("bf16", "64,128,256"), ("fp32", "64")])
def test_defaults_compile_for_sm90(dtype, dims):
    r = kernels_check("--gpu", "H100", "--dtype", dtype, "--head-dim", dims, "--format", "json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)
    kernels = {(row["head_dim"], row["variant"].split("-")[0], row["kernel"]) for row in rows}
    for d in map(int, dims.split(",")):
        assert {(d, "fwd", "fwd"), (d, "bwd", "pre"), (d, "bwd", "dkdv"), (d, "bwd", "dq")} <= kernels
    assert all(row["fits"] and 0 < row["smem"] <= 232448 for row in rows)


def test_a_config_too_big_for_shared_memory_is_reported():
    r = kernels_check("fwd-m256-n128-w8-s5", "--head-dim", "256", "--gpu", "H100")
    assert r.returncode == 1 and "BAD" in r.stdout, r.stdout + r.stderr


def test_masked_variants_compile_for_sm90():
    # every mask's code (window, softcap, block-sparse with an element mask) builds for Hopper
    # with the launchers' argument types; fits shared memory (spills are reported, not judged:
    # bench/mask_bench.py times them)
    r = kernels_check("--gpu", "H100", "--head-dim", "64", "--no-causal", "--format", "json",
                      "fwd-m64-n64-w4-s2-window=true-softcap=true",
                      "fwd-m64-n32-w4-s2-loads=descriptor-block_sparse=true",
                      "bwd-m32-n64-w4-s2-dq=separate-mq64-nq32-wq4-sq2-window=true-softcap=true"
                      "-block_sparse=true",
                      # dq="fused": the dQ programs' code (and its block lists) in the dK/dV kernel
                      "bwd-m32-n64-w4-s2-dq=fused-mq64-nq32-window=true-softcap=true"
                      "-block_sparse=true",
                      "splitkv-m64-n64-w4-s3-window=true-softcap=true-paged=true",
                      # splitkv serving a decode-shaped dense call with a block mask
                      "splitkv-m16-n64-w4-s3-loads=descriptor-block_sparse=true-softcap=true"
                      "-window=true")
    rows = json.loads(r.stdout) if r.stdout.strip().startswith("[") else None
    assert rows, r.stdout[-3000:] + r.stderr[-3000:]
    kernels = {(row["variant"].split("-")[0], row["kernel"]) for row in rows}
    assert {("fwd", "fwd"), ("bwd", "dkdv"), ("bwd", "dq"), ("bwd", "pre"),
            ("splitkv", "partial")} <= kernels
    assert all(0 < row["smem"] <= 232448 for row in rows)


def test_paged_splitkv_loop_stays_pipelined():
    # the paged key loop must keep its K/V tiles in flight through shared memory like the
    # contiguous one (a table read two blocks ahead once made Triton drop the pipelining: the
    # paged kernel compiled to 22 KB of shared memory against 70 KB, loads straight to registers)
    r = kernels_check("--gpu", "H100", "--head-dim", "128", "--no-causal", "--format", "json",
                      "splitkv-m16-n64-w4-s3", "splitkv-m16-n64-w4-s3-paged=true")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    smem = {row["variant"]: row["smem"] for row in json.loads(r.stdout) if row["kernel"] == "partial"}
    stages = 2 * 64 * 128 * 2 * 2  # two K/V tiles (64 keys x 128 x bf16, K and V) in flight
    assert smem["splitkv-m16-n64-w4-s3"] >= stages
    assert smem["splitkv-m16-n64-w4-s3-paged=true"] >= stages, smem


# ptxas -v's own lines for tile_overlap's render (session 21: S_0 carried across the tile loop's
# back edge; it compiled spill-free and ran 25-40% slower on the H100)
_SERIALIZED_LOG = """\
ptxas info    : (C7517) wgmma.wait_group is injected in around line 6243 by compiler to allow use of registers defined by GMMA in function 'attn_fwd_hopper'
ptxas info    : (C7517) wgmma.wait_group is injected in around line 6245 by compiler to allow use of registers defined by GMMA in function 'attn_fwd_hopper'
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'attn_fwd_hopper'
ptxas info    : Compiling entry function 'attn_fwd_hopper' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 3 barriers
"""


def test_serialized_wgmmas_fail_the_check():
    """A kernel ptxas serialized (or made wait on its wgmmas) does not ship, spill-free or not:
    the notes are read once per kind, without their PTX line numbers."""
    from flashtune import targets
    from flashtune.cli_kernels import _problems
    from flashtune.codegen import Variant
    from flashtune.codegen.aot import _wgmma_notes
    notes = _wgmma_notes(_SERIALIZED_LOG)
    assert notes == ["C7512 wgmma.mma_async instructions are serialized due to insufficient "
                     "register resources",
                     "C7517 wgmma.wait_group is injected by compiler to allow use of registers "
                     "defined by GMMA"]
    assert _wgmma_notes(_SERIALIZED_LOG.split("ptxas info    : Compiling")[1]) == []
    v = Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24")
    h100 = targets.get("H100")
    why = _problems(v, {"smem": 100_000, "spill_bytes": 0, "wgmma": notes}, h100)
    assert len(why) == 1 and why[0].startswith("ptxas: C7512") and "C7517" in why[0]
    assert _problems(v, {"smem": 100_000, "spill_bytes": 0, "wgmma": []}, h100) == []


def test_a_shipped_tables_records_compile_clean():
    """--table compiles the records of the GPU's shipped table at their buckets' head dim,
    dtype and causality (narrowed here to hopper_fwd at D=64, non-causal): every distinct one,
    each without serialized wgmmas and spill-free but where noted below (session 21 checked the
    whole H100 and H200 tables so)."""
    from pathlib import Path
    doc = json.loads((Path(__file__).parents[1] / "tuned_db" / "tables"
                      / "nvidia-h100-80gb-hbm3.json").read_text())
    want = {json.dumps(r["variant"], sort_keys=True) for r in doc["records"]
            if r["variant"]["family"] == "hopper_fwd" and r["bucket"]["head_dim"] == 64
            and not r["bucket"]["causal"]}
    r = kernels_check("--gpu", "H100", "--table", "--family", "hopper_fwd", "--head-dim", "64",
                      "--no-causal", "--format", "json")
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else None
    assert rows, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(rows) == len(want) >= 2
    assert all(x["head_dim"] == 64 and not x["causal"] and x["variant"].startswith("hopper_fwd")
               and x["smem"] <= 232448 and x["wgmma"] == [] for x in rows), rows
    # spill-free, but for the three-consumer 128-key one-loop records (session 32: measured
    # fastest on the H100 with triton 3.6, 1.09-1.16x cuDNN, where they spill 20 B -- three
    # registers of the key tail's mask, stored once a tile and reloaded on masked steps only, in
    # the SASS; triton 3.9 spills 184 B in the same places: a tile's prologue and its masked
    # steps). The exit status says whether any record spilled.
    wide = [x for x in rows if "three_consumers=true" in x["variant"] and "-n128-" in x["variant"]
            and "causal_split=false" in x["variant"]]
    assert all(x["spill_bytes"] == 0 for x in rows if x not in wide), rows
    assert all(x["spill_bytes"] <= 256 for x in wide), wide
    assert r.returncode == (1 if any(x["spill_bytes"] for x in rows) else 0), r.stderr[-2000:]
    bad = kernels_check("--table", "fwd-m64-n64-w4-s2")
    assert bad.returncode == 2 and "VARIANTS or --table" in bad.stderr, bad.stderr



def test_early_start_renders_compile_for_sm90():
    # splitkv's early_start (prefetch, wait, let the next kernel in), contiguous, paged and with
    # TMA loads, build for Hopper without spills, as the launch takes them for records
    r = kernels_check("--gpu", "H100", "--head-dim", "128", "--format", "json",
                      "splitkv-m64-n64-w4-s3-early_start=true",
                      "splitkv-m16-n32-w1-s1-sp64-early_start=true",
                      "splitkv-m64-n64-w4-s3-early_start=true-paged=true",
                      "splitkv-m64-n64-w4-s3-loads=descriptor-early_start=true")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert len({row["variant"] for row in rows}) == 4
    assert all(row["fits"] and not row.get("spill_bytes") for row in rows), rows


_BEFORE_WAIT = r'''
import json, re, sys
from flashtune.codegen import Variant
from flashtune.families.splitkv import compile_check
out = {}
for name in sys.argv[1:]:
    ptx = compile_check(Variant.parse(name), 128, "bfloat16", False, False, 90,
                        False)["partial"]["ptx"].splitlines()
    wait = [i for i, l in enumerate(ptx) if "griddepcontrol.wait" in l]
    mem = [l.strip() for l in ptx[:wait[0]] if re.search(
        r"\b(ld|st|atom|red|cp\.async|prefetch|tensormap)\.", l)] if wait else None
    out[name] = mem
print(json.dumps(out))
'''


def test_early_start_touches_nothing_before_its_wait():
    # the early_start contract (attn_splitkv.py.tmpl's header): before gdc_wait the partial
    # kernel only prefetches K/V to L2, reads the block table through L2 and (the gluon render,
    # PRELOAD) loads K/V tiles into its own shared memory by TMA -- no store, no atomic, no
    # L1-cached load, no tensor-descriptor write (Triton's descriptor scratch is stream-ordered
    # memory the kernel before may still use); Q and the lengths only after it
    names = ["splitkv-m64-n64-w4-s3-early_start=true",
             "splitkv-m64-n64-w4-s3-early_start=true-paged=true",
             "splitkv-m64-n64-w4-s3-loads=descriptor-early_start=true",
             "splitkv-m64-n64-w4-s3-early_start=true-window=true-softcap=true",
             # the gluon render (compiled with every stage preloaded), contiguous and paged
             "splitkv-m64-n64-w4-s2-early_start=true-gluon=true",
             "splitkv-m64-n64-w4-s2-early_start=true-gluon=true-paged=true"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _BEFORE_WAIT, *names], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, mem in got.items():
        assert mem is not None, f"{name}: no griddepcontrol.wait in its PTX"
        assert any(m.startswith("prefetch.global.L2") for m in mem), (name, mem)
        tma = ("cp.async.bulk.tensor.2d.shared::cta.global",) if "gluon" in name else ()
        bad = [m for m in mem if not re.sub(r"^@%p\d+\s+", "", m).startswith(
            ("prefetch.global.L2", "ld.global.cg", "ld.param", "ld.shared", "st.shared", *tma))]
        assert not bad, f"{name} touches memory before its wait: {bad}"
        assert bool(tma) == any("cp.async.bulk.tensor" in m for m in mem), (name, mem)
        assert any("ld.global.cg" in m for m in mem) == ("paged" in name), (name, mem)
