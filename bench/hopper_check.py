"""One device call for the hopper_fwd family: correctness of each candidate against the float64
reference (O and LSE; odd lengths, GQA, causal with rows that see no key, both dtypes), then the
standard grid timed against SDPA's flash and cuDNN backends and flashtune's generic forward.

    python3 bench/hopper_check.py [--variants a,b,...] [--head-dims 64,128] [--budget 270]
    python3 bench/hopper_check.py --set no_loader   # the schedules without a loader partition,
                                                    # beside each D's default
    python3 bench/hopper_check.py --set tiles       # 128-key steps with a loader, causal_split
                                                    # on and off, beside each D's default

Every candidate runs in its own subprocess with a timeout (a Gluon kernel whose mbarrier phases
are wrong hangs rather than fails). Rows go to $OUT/hopper_fwd.jsonl; a table is printed last.
TFLOP/s = 4*B*H*Nq*Nk*D / t, halved for causal (DESIGN's convention); medians of do_bench,
which flushes L2 between runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

CANDIDATES = {  # spill-free under the 168-register entry cap Triton gives ptxas (sm_90 compile)
    64: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24",
         "hopper_fwd-m128-n64-w8-s2-lr24",
         "hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24",
         "hopper_fwd-m64-n64-w4-s2-pingpong=true-persistent=true-lr24"],
    128: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24",
          "hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24",
          "hopper_fwd-m128-n64-w8-s2-lr24",
          "hopper_fwd-m64-n64-w4-s2-pingpong=true-persistent=true-lr24",
          "hopper_fwd-m128-n64-w8-s3-lr24"],
    256: ["hopper_fwd-m128-n32-w8-s2-lr24",
          "hopper_fwd-m64-n32-w4-s2-pingpong=true-lr24"],
}
# loader_regs 0: no loader partition, the consumers load the K/V ring (two consumer warpgroups are
# all 256 threads: a 255-register cap), so 128-key steps fit at D=128 (sm_90 compile: 0 spills)
NO_LOADER = {
    64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true",
         "hopper_fwd-m64-n64-w4-s4-pingpong=true"],
    128: ["hopper_fwd-m128-n128-w8-s2",
          "hopper_fwd-m64-n128-w4-s3-pingpong=true",
          "hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true",
          "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true"],
    256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true",
          "hopper_fwd-m64-n32-w4-s3-pingpong=true"],
}
# 128-key steps with a loader warp (issue 10): spill-free since P is converted to the PV operand
# right after the softmax and causal_split keeps the mask code out of the unmasked loop (sm_90
# compile, template header); causal_split=false beside, to time the split itself
TILES = {
    64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"],
    128: ["hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24",
          "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24",
          "hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr24",
          "hopper_fwd-m64-n128-w4-s2-causal_split=false-pingpong=true-lr24",
          "hopper_fwd-m128-n128-w8-s2-lr24"],
    256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24",
          "hopper_fwd-m64-n64-w4-s2-causal_split=false-pingpong=true-lr24"],
}
# a second Q buffer per consumer (q_buffers 2, persistent with a loader): the tuned tables'
# persistent winners, each with one and two Q buffers (s2 where s3's ring leaves no room)
QBUF = {
    64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-persistent=true-lr24",
         "hopper_fwd-m64-n128-w4-s3-pingpong=true-persistent=true-lr24-qb2",
         "hopper_fwd-m128-n64-w4-s3-pingpong=true-persistent=true-lr24",
         "hopper_fwd-m128-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2"],
    128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-persistent=true-lr24",
          "hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr24-qb2",
          "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24",
          "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2",
          "hopper_fwd-m64-n64-w4-s4-pingpong=true-persistent=true-lr24-qb2"],
    256: ["hopper_fwd-m64-n32-w4-s3-pingpong=true-persistent=true-lr24",
          "hopper_fwd-m64-n32-w4-s3-pingpong=true-persistent=true-lr24-qb2"],
}
# the causal tile order in L2-sized sections of heads (l2_order): the H100 table's short causal
# records and the defaults, each without and with it (ncu, causal D=128 N=1k: DRAM 84% busy
# re-reading K/V the tiles in flight had evicted from L2)
L2ORDER = {
    64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24",
         "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-l2_order=true"],
    128: ["hopper_fwd-m64-n64-w4-s4-causal_split=false-pingpong=true-persistent=true-lr32-qb2",
          "hopper_fwd-m64-n64-w4-s4-causal_split=false-pingpong=true-persistent=true-lr32-qb2"
          "-l2_order=true",
          "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24",
          "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-l2_order=true"],
    256: ["hopper_fwd-m64-n32-w4-s4-causal_split=false-pingpong=true-lr40",
          "hopper_fwd-m64-n32-w4-s4-causal_split=false-pingpong=true-lr40-l2_order=true"],
}
# D=256 (issue 10: 0.70-0.91x cuDNN there): 128 query rows sharing each K/V stage as FA3 runs
# D=256 (two consumer warpgroups, no ping-pong turns, 64-80-key steps), with and without a loader
# warp, beside the shipped records (m64-n64-s3 one consumer; m64-n32 ping-pong) and ping-pong's
# 64-key steps (4-8 B of spills, sm_90 compile)
D256 = {
    256: ["hopper_fwd-m64-n64-w4-s3-lr24",
          "hopper_fwd-m128-n64-w8-s2-lr24",
          "hopper_fwd-m128-n64-w8-s2-persistent=true-lr24",
          "hopper_fwd-m128-n64-w8-s2",
          "hopper_fwd-m128-n32-w8-s3-lr24",
          "hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24",
          "hopper_fwd-m64-n64-w4-s2-pingpong=true"],
}
# K/V stages handed back without a barrier over the consumer's warps (release_barrier=false)
# beside the same schedules with it: each D's default (appended) and the D=128/256 records
RELEASE = {
    64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-release_barrier=false"],
    128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-release_barrier=false"],
    256: ["hopper_fwd-m64-n64-w4-s3-lr24",
          "hopper_fwd-m64-n64-w4-s3-lr24-release_barrier=false",
          "hopper_fwd-m64-n32-w4-s3-pingpong=true-lr24-release_barrier=false"],
}
# O rescaled under S_j's wgmma (early_rescale, FA3's order) beside the same schedules without
# it: each D's default (appended), FA3's D=256 shape and the D=128 8-warp consumer
RESCALE = {
    64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-early_rescale=true"],
    128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-early_rescale=true",
          "hopper_fwd-m128-n128-w8-s2-lr24",
          "hopper_fwd-m128-n128-w8-s2-lr24-early_rescale=true"],
    256: ["hopper_fwd-m64-n32-w4-s3-pingpong=true-lr24-early_rescale=true",
          "hopper_fwd-m128-n64-w8-s2-lr24",
          "hopper_fwd-m128-n64-w8-s2-lr24-early_rescale=true"],
}
# K's half of each stage handed back after S = Q K^T (early_k_release) beside the same schedules
# without it: the D=256 two-stage ping-pong whose consumers waited on K (ncu, session 18), the
# D=256 record, FA3's D=256 shape, and each D's default (appended)
KRELEASE = {
    128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-early_k_release=true",
          "hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24",
          "hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24-early_k_release=true"],
    256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24",
          "hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24-early_k_release=true",
          "hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24-early_rescale=true-early_k_release=true",
          "hopper_fwd-m64-n64-w4-s3-lr24",
          "hopper_fwd-m64-n64-w4-s3-lr24-early_k_release=true",
          "hopper_fwd-m128-n64-w8-s2-lr24-early_k_release=true",
          "hopper_fwd-m64-n32-w4-s3-pingpong=true-lr24-early_k_release=true"],
}
# a tile's O store waited for under the next tile's first QK^T (async_o_store) beside the same
# short-sequence records (two Q buffers, persistent) without it (ncu, session 18: the epilogue's
# store wait held 6.6% of the causal D=128 N=512 kernel's samples)
_OSTORE_BASE = {
    64: ["hopper_fwd-m128-n64-w4-s4-causal_split=false-pingpong=true-persistent=true-lr24-qb2",
         "hopper_fwd-m64-n128-w4-s3-causal_split=false-pingpong=true-persistent=true-lr32-qb2"
         "-early_k_release=true"],
    128: ["hopper_fwd-m64-n64-w4-s4-causal_split=false-pingpong=true-persistent=true-lr56-qb2"
          "-l2_order=true-early_rescale=true",
          "hopper_fwd-m64-n64-w4-s4-pingpong=true-persistent=true-lr24-qb2-early_k_release=true"],
    256: ["hopper_fwd-m64-n32-w4-s3-causal_split=false-pingpong=true-persistent=true-lr32-qb2"
          "-early_k_release=true"],
}
OSTORE = {d: [x for n in names for x in (n, n + "-async_o_store=true")]
          for d, names in _OSTORE_BASE.items()}
SETS = {"loader": CANDIDATES, "no_loader": NO_LOADER, "tiles": TILES, "qbuf": QBUF,
        "l2order": L2ORDER, "d256": D256, "release": RELEASE, "rescale": RESCALE,
        "krelease": KRELEASE, "ostore": OSTORE}
# (B, H, Hk, Nq, Nk, causal): odd lengths, a single key/query, GQA, Nq > Nk causal (the first
# Nq - Nk rows see no key), a multi-tile causal case
CHECK_SHAPES = [(1, 2, 2, 1, 1, False), (2, 3, 3, 37, 37, True), (1, 4, 2, 113, 203, False),
                (1, 4, 1, 1000, 1000, True), (2, 2, 2, 300, 100, True), (1, 2, 2, 1024, 1024, False),
                (1, 8, 2, 515, 2051, True)]


def _out(name):
    d = os.environ.get("OUT") or "bench_out"
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, name)


def _emit(row):
    print("ROW " + json.dumps(row), flush=True)


def check_one(name: str, dims) -> None:
    """Correctness of one variant (in a subprocess): O against the float64 reference with the
    project's tolerance, LSE within 1e-3 (and -inf exactly where a row sees no key)."""
    import torch

    import flashtune
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    d = dims[0]
    for dtype in (torch.bfloat16, torch.float16):
        for (b, h, hk, nq, nk, causal) in CHECK_SHAPES:
            q = torch.randn(b, h, nq, d, dtype=dtype, device="cuda")
            k = torch.randn(b, hk, nk, d, dtype=dtype, device="cuda")
            v = torch.randn(b, hk, nk, d, dtype=dtype, device="cuda")
            t0 = time.time()
            with flashtune.force(name):
                o, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
            torch.cuda.synchronize()
            ref, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
            rep = compare(o, ref, same_dtype_math(q, k, v, causal=causal))
            lse64, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
            inf_ok = bool(torch.equal(torch.isinf(lse64), torch.isinf(ref_lse)))
            fin = torch.isfinite(ref_lse)
            lse_err = float((lse64[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
            ok = rep.ok and inf_ok and lse_err < 1e-3
            _emit(dict(kind="check", variant=name, dtype=str(dtype)[6:], D=d, B=b, H=h, Hk=hk,
                       Nq=nq, Nk=nk, causal=causal, ok=ok, o=str(rep), lse_err=lse_err,
                       lse_inf_ok=inf_ok, s=round(time.time() - t0, 2)))
    # a (B, N, H, D) layout viewed as (B, H, N, D): the descriptors' merged strides
    q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(2, 300, 2, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    v = torch.randn(2, 300, 2, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    with flashtune.force(name):
        o = flashtune.attention(q, k, v, causal=True)
    rep = compare(o, reference(q, k, v, causal=True), same_dtype_math(q, k, v, causal=True))
    _emit(dict(kind="check", variant=name, dtype="bfloat16", D=d, layout="bnhd", ok=rep.ok,
               o=str(rep)))


def time_one(name: str, dims, seqlens) -> None:
    """Time one implementation over the standard grid (in a subprocess)."""
    import torch
    import triton

    from flashtune.codegen import Variant
    from flashtune.defaults import default_variant
    for d in dims:
        if name.startswith("hopper_fwd") and not name.endswith(f"@{d}"):
            continue
        label = name.split("@")[0]
        for causal in (False, True):
            for n in seqlens:
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, dtype=torch.bfloat16, device="cuda")
                           for _ in range(3))
                if label in ("flash", "cudnn"):
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    be = {"flash": SDPBackend.FLASH_ATTENTION,
                          "cudnn": SDPBackend.CUDNN_ATTENTION}[label]

                    def fn():
                        with sdpa_kernel(be):
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=causal)
                else:
                    # the plan built once, as ops.run_forward memoizes it: a call is the launch
                    if label == "fwd":
                        from flashtune.launch import FwdPlan
                        plan = FwdPlan(q, k, v, causal, None, default_variant("fwd", d, "bfloat16"))
                    else:
                        from flashtune.launch_hopper import HopperFwdPlan
                        plan = HopperFwdPlan(q, k, v, causal, None, Variant.parse(label))
                        assert plan.fallback is None, plan.why

                    def fn(plan=plan):
                        return plan.run(q, k, v)
                try:
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                except Exception as e:  # noqa: BLE001 -- a failing config is a result
                    _emit(dict(kind="time", impl=label, D=d, N=n, causal=causal,
                               error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                _emit(dict(kind="time", impl=label, D=d, N=n, causal=causal, B=b, H=h,
                           ms=ms, tflops=flops / ms / 1e9))


def _sub(args, timeout):
    """Run this script on `args` in a subprocess; its ROW lines, or a timeout/crash row."""
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                           timeout=timeout)
        rows = [json.loads(x[4:]) for x in r.stdout.splitlines() if x.startswith("ROW ")]
        if r.returncode:
            rows.append(dict(kind="crash", args=args, rc=r.returncode,
                             tail=(r.stdout + r.stderr)[-1500:]))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rows = [json.loads(x[4:]) for x in out.splitlines() if x.startswith("ROW ")]
        rows.append(dict(kind="timeout", args=args, after_s=timeout))
    print(f"  {' '.join(args)[:90]}: {len(rows)} rows, {time.time() - t0:.0f} s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="all", choices=["all", "check", "time"])
    ap.add_argument("name", nargs="?", default="")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--bench-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--variants", default="")
    ap.add_argument("--budget", type=float, default=270)
    ap.add_argument("--check-timeout", type=float, default=60)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--baselines", default="cudnn,flash,fwd")
    ap.add_argument("--per-dim", type=int, default=0, help="only the first N candidates per D")
    ap.add_argument("--set", choices=sorted(SETS), default="loader",
                    help="the candidate list (no_loader: loader_regs 0; tiles: 128-key steps "
                         "with a loader; qbuf: persistent winners with 1 and 2 Q buffers; each "
                         "with its D's default beside)")
    a = ap.parse_args()
    seqlens = [int(x) for x in a.seqlens.split(",")]
    if a.mode == "check":
        return check_one(a.name, [int(a.head_dims)])
    if a.mode == "time":
        return time_one(a.name, [int(x) for x in a.bench_dims.split(",")], seqlens)
    t_start = time.time()
    import torch
    import triton
    env = dict(kind="env", device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda, date=time.strftime("%F"))
    rows = [env]
    print(env, flush=True)
    dims = [int(x) for x in a.head_dims.split(",")]
    # --variants a@128,b@64,...: those, per head dim (default: the first --per-dim CANDIDATES)
    given = [v.split("@") for v in a.variants.split(",") if v]
    chosen = {d: [n for n, dd in given if int(dd) == d] if given else
              SETS[a.set].get(d, [])[:a.per_dim or None] for d in dims}
    if a.set != "loader" and not given:  # the shipped default beside, timed in the same run
        from flashtune.families import get
        for d in dims:
            chosen[d].append(get("hopper_fwd").default(d, "bfloat16").name)
    good = {d: [] for d in dims}
    if not a.skip_check:
        for d in dims:
            for v in chosen[d]:
                got = _sub(["check", v, "--head-dims", str(d)], a.check_timeout)
                rows += got
                checks = [r for r in got if r.get("kind") == "check"]
                bad = [r for r in checks if not r["ok"]]
                if checks and not bad and len(checks) == 2 * len(CHECK_SHAPES) + 1:
                    good[d].append(v)
                for r in bad[:3]:
                    print("   FAIL", {k: r.get(k) for k in ("dtype", "Nq", "Nk", "Hk", "causal",
                                                        "o", "lse_err", "lse_inf_ok")})
    else:
        good = chosen
    bench_dims = [int(x) for x in a.bench_dims.split(",")]
    impls = [b for b in a.baselines.split(",") if b] + [f"{v}@{d}" for d in bench_dims for v in good.get(d, [])]
    for impl in impls:
        left = a.budget - (time.time() - t_start)
        if left < 20:
            print("budget spent; skipped", impl)
            continue
        rows += _sub(["time", impl, "--bench-dims", ",".join(map(str, bench_dims)),
                      "--seqlens", a.seqlens], min(left, 150))
        _save(rows)  # after each implementation: a run cut short keeps what it timed
    _save(rows)
    _table(rows)


def _save(rows):
    with open(_out("hopper_fwd.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _table(rows):
    times = [r for r in rows if r.get("kind") == "time" and "ms" in r]
    base = {(r["D"], r["N"], r["causal"]): r["ms"] for r in times if r["impl"] == "cudnn"}
    impls = sorted({r["impl"] for r in times}, key=lambda x: (x not in ("cudnn", "flash", "fwd"), x))
    print("\nTFLOP/s (bf16, standard grid) and geomean vs cuDNN")
    for impl in impls:
        mine = [r for r in times if r["impl"] == impl]
        ratios = [base[(r["D"], r["N"], r["causal"])] / r["ms"] for r in mine
                  if (r["D"], r["N"], r["causal"]) in base]
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
        cells = " ".join(f"{r['tflops']:.0f}" for r in sorted(mine, key=lambda r: (
            r["D"], r["causal"], r["N"])))
        print(f"{impl[:72]:72} geo {gm:.3f}x  {cells}")
    for r in rows:
        if r.get("kind") in ("crash", "timeout"):
            print(r.get("kind"), r.get("args"), str(r.get("tail", ""))[-600:])


if __name__ == "__main__":
    main()
