"""Backward candidates against FlexAttention (issues 10, 11): bwd variants forced beside the bwd
as dispatched, FlexAttention (torch.compile'd) and SDPA cuDNN / flash, backward only, bf16.

    python3 bench/bwd_cands_bench.py                   # D=128 (STEPS=bwdcands)
    python3 bench/bwd_cands_bench.py --head-dims 128,64
    TRITON_INTERPRET=1 python3 bench/bwd_cands_bench.py --smoke   # CPU: tiny shapes, no peers

Cases, most wanted first (a run cut by --budget-s or the step's timeout keeps what it measured):
the causal sliding window N=16k W=1024 (B=1, H=16), then the dense standard grid (B*N = 16k
tokens, H = 2048 / D) at N = 16k, 4k, 1k, causal and not. Peers: "flashtune" (the bwd as
dispatched: tuned table or built-in default), one Forced peer per candidate (CANDIDATES, below;
a window call runs each one's window twin), "flex", "sdpa-cudnn", "sdpa-flash" (dense only).
Timing, inputs and the backward alone on one saved graph are flashtune/bench's (runner.time_cell:
CUDA events, L2 flushed, median); max_abs_diff is against the dispatched bwd's gradients.

Before timing, every (case, peer) runs once in a pool of --jobs processes, each on the GPU
with the real shapes: Triton's and Inductor's on-disk caches then hold every kernel, so the
timed process compiles nothing (a cold start compiled ~80 Triton kernels and 7 Flex graphs).

Output: one JSON line per cell in $OUT/bwd_cands.jsonl (--out), the first line the environment,
then a table per case (ms, TFLOP/s, / flex, / dispatched) and per peer the geomean of its time
over Flex's and over the dispatched bwd's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashtune.bench import grid, peers as P, runner  # noqa: E402
from flashtune.bench.grid import Case, WindowMask  # noqa: E402

# Candidates per head dim, none of them a shipped H100 record except the D=128 default (the
# 1k causal bucket's). `flashtune kernels check`, sm_90, triton 3.9, bf16, 2026-11-23
# (docs/data/bwd_cands_compile_sm90_2026-11-23.jsonl): dK/dV kernel registers causal /
# non-causal / causal window twin (spill bytes where any), then the separate dQ kernel's
# (causal); fused: the one kernel. The window twins with the window mask as one offset tile
# (attn_bwd.py.tmpl _dkdv_inner; before it the m64-n128 ones spilled 40-44 B). D=128:
#   default      230 / 212 / 233             dQ 191   (the window twin's dQ 221)
#   flex-tiles   250 / 255 (4 B) / 255       dQ 213   FlexAttention's sm_90 D=128 config
#   m64s3-sq2    250 / 255 (4 B) / 255       dQ 191
#   m32s3        225 / 212 / 236             dQ 213
#   m64n64       217 / 203 / 234             dQ 180
#   m32n64w4     229 / 213 / 248             dQ 168
#   atomic-s3    230 / 218 / 236
#   fused        229 / 212 / 237; fused-s3 225 / 212 / 236; fused-m64n64 216 / 203 / 227
#   fused-flex   255 (28 B) / 255 / 255 (8 B)  Flex's tiles and one launch
# (m64-n128-w8-s2 spills 12 B causal, its dQ-64x128 twins 20-36 B, m64-n64-w4 8-28 B: left out.)
# D=64: every one 138-209 registers, no spills.
CANDIDATES = {
    128: {
        "default": "bwd-m32-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2",   # the built-in default
        "flex-tiles": "bwd-m64-n128-w8-s3-dq=separate-mq128-nq64-wq8-sq3",
        "m64s3-sq2": "bwd-m64-n128-w8-s3-dq=separate-mq128-nq64-wq8-sq2",
        "m32s3": "bwd-m32-n128-w8-s3-dq=separate-mq128-nq64-wq8-sq3",
        "m64n64": "bwd-m64-n64-w8-s3-dq=separate-mq64-nq64-wq8-sq3",
        "m32n64w4": "bwd-m32-n64-w4-s3-dq=separate-mq64-nq32-wq4-sq3",
        "atomic-s3": "bwd-m32-n128-w8-s3-dq=atomic",
        "fused": "bwd-m32-n128-w8-s2-dq=fused-mq128-nq64",                # default tiles, fused
        "fused-s3": "bwd-m32-n128-w8-s3-dq=fused-mq128-nq64",
        "fused-m64n64": "bwd-m64-n64-w8-s3-dq=fused-mq64-nq64",
        "fused-flex": "bwd-m64-n128-w8-s3-dq=fused-mq128-nq64",
        # loads=descriptor: Q/dO through TMA, dQ by one TMA reduce-add per tile (dq=atomic).
        # triton 3.9, sm_90, bf16, causal / non-causal registers (2026-11-25): atomic-tma
        # 255 (36 B spilled) / 255, atomic-tma-m32 208 / 202, fused-tma 212 / 210,
        # fused-flex-tma 252 / 250 (its pointer twin above spills 28 B)
        "atomic-tma": "bwd-m64-n128-w8-s2-loads=descriptor-dq=atomic",
        "atomic-tma-m32": "bwd-m32-n128-w8-s2-loads=descriptor-dq=atomic",
        "fused-tma": "bwd-m32-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64",
        "fused-flex-tma": "bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64",
        "default-tma": "bwd-m32-n128-w8-s2-loads=descriptor-dq=separate-mq128-nq64-wq8-sq2",
        # dq_loads: the fused dQ programs' K and V through descriptors too (session 17), beside
        # the sm_90 default and the H100 table's 16k non-causal record without it
        "fused-flex-tma-kv": "bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64-dq_loads=descriptor",
        "fused-m64n64w4": "bwd-m64-n64-w4-s2-dq=fused-mq64-nq64",
        "fused-m64n64w4-kv": "bwd-m64-n64-w4-s2-dq=fused-mq64-nq64-dq_loads=descriptor",
        # hopper_bwd: the H100 table's D=128 record, and with dq_overlap (session 22)
        "hb": "hopper_bwd-m64-n128-w8-s1",
        "hb-ov": "hopper_bwd-m64-n128-w8-s1-dq_overlap=true",
    },
    # hopper_bwd, the one D=256 tile: the H100 table's old record (s2), and with dq_overlap
    # at s2 and s1 (session 22; sm_90 compile, bf16: s2 255 registers, 0 B spilled)
    256: {
        "hb": "hopper_bwd-m64-n64-w8-s2",
        "hb-ov": "hopper_bwd-m64-n64-w8-s2-dq_overlap=true",
        "hb-s1-ov": "hopper_bwd-m64-n64-w8-s1-dq_overlap=true",
    },
    64: {
        "default": "bwd-m32-n128-w8-s3-dq=separate-mq128-nq64-wq8-sq2",   # the built-in default
        "flex-tiles": "bwd-m64-n128-w8-s3-dq=separate-mq128-nq64-wq8-sq3",  # Flex's sm_90 tiles
        "fused": "bwd-m32-n128-w8-s3-dq=fused-mq128-nq64",
        "fused-flex": "bwd-m64-n128-w8-s3-dq=fused-mq128-nq64",
        "atomic-tma": "bwd-m64-n128-w8-s2-loads=descriptor-dq=atomic",
        "atomic-tma-m32": "bwd-m32-n128-w8-s2-loads=descriptor-dq=atomic",
        "fused-flex-tma": "bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64",
        "hb": "hopper_bwd-m64-n128-w8-s2",
        "hb-ov": "hopper_bwd-m64-n128-w8-s2-dq_overlap=true",
    },
}
WINDOW_N, WINDOW_KEYS = 16384, 1024
SEQLENS = (16384, 4096, 1024)


def window_mask(keys: int) -> str:
    """The MASKS entry of a causal sliding window of `keys` keys (each query, itself included),
    registered once: the bench's peers read their masks from grid.MASKS."""
    name = f"window{keys}"
    grid.MASKS.setdefault(name, WindowMask("window", f"causal sliding window of {keys} keys",
                                           left=keys))
    return name


def make_cases(dims, seqlens, window: tuple | None, tokens: int, hidden: int) -> list[Case]:
    out = []
    for d in dims:
        h = hidden // d
        if window and d == dims[0]:
            n, keys = window
            out.append(Case("masks", "bwd", 1, h, h, n, n, d, True, mask=window_mask(keys)))
        out += [Case("dense", "bwd", max(1, tokens // n), h, h, n, n, d, c)
                for n in seqlens for c in (True, False)]
    return out


def chosen(dims, names=None) -> dict:
    """{label: {head dim: variant name}} of the candidates to time (names: which; None = all)."""
    out: dict = {}
    for d in dims:
        for label, name in CANDIDATES.get(d, {}).items():
            if names is None or label in names:
                out.setdefault(label, {})[d] = name
    return out


def make_peers(spec: dict, with_peers: bool = True) -> list:
    """The dispatched bwd, a Forced peer per candidate of `spec` (chosen()), and the peers."""
    from flashtune.codegen import Variant
    out = [P.Flashtune(True)]
    out += [P.Forced(label, {d: Variant.parse(v) for d, v in vs.items()})
            for label, vs in spec.items()]
    if with_peers:
        out += [P.Flex(), P.Sdpa("cudnn"), P.Sdpa("flash")]
    if len({p.name for p in out}) != len(out):
        raise ValueError(f"peer names collide: {[p.name for p in out]}")
    return out


def runs(case: Case, peer) -> bool:
    return not (case.section == "masks" and peer.name.startswith("sdpa"))


def _warm(job) -> str:
    """One (case, peer) run once in a worker process, so its kernels land in the on-disk caches."""
    case_d, peer_name, spec, dev = job
    if case_d["mask"]:  # this process's grid.MASKS lacks the main process's window entry
        window_mask(int(case_d["mask"].removeprefix("window")))
    case = Case(**case_d)
    peer = next(p for p in make_peers(spec) if p.name == peer_name)
    t = time.perf_counter()
    try:
        if peer.why_not(case, dev):
            return f"{peer_name}: skipped"
        inp = P.make_inputs(case, dev)
        with peer.context(case):
            runner._timed(case, peer.prepare(case, inp), inp)
        if dev == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 -- the timed run reports it as its cell
        return f"{peer_name} {case.label}: {type(e).__name__} {str(e)[:120]}"
    return f"{peer_name} {case.label}: {time.perf_counter() - t:.1f} s"


def _one_compile_thread() -> None:
    # the pool is the parallelism: Inductor's own compile workers in each process would
    # oversubscribe the CPUs
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"


def warm_all(cases, spec: dict, jobs: int, deadline_s: float, dev: str = "cuda") -> None:
    """Run every (case, peer) once in `jobs` processes, the most wanted cases first; what has not
    started after deadline_s is dropped (the timed run then compiles it itself)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    work = [({f: getattr(c, f) for f in Case.__dataclass_fields__}, p.name, spec, dev)
            for c in cases for p in make_peers(spec) if runs(c, p)
            and not p.name.startswith("sdpa")]
    t = time.perf_counter()
    ex = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"),
                                initializer=_one_compile_thread)
    futures = [ex.submit(_warm, w) for w in work]
    done = 0
    try:
        for fut in cf.as_completed(futures, timeout=deadline_s):
            done += 1
            print("warm", fut.result(), flush=True)
    except cf.TimeoutError:
        print(f"warm: deadline {deadline_s:.0f} s, {len(work) - done} cells left", flush=True)
    ex.shutdown(wait=False, cancel_futures=True)
    print(f"warmed {done} of {len(work)} cells in {time.perf_counter() - t:.0f} s "
          f"({jobs} processes)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--no-window", action="store_true")
    ap.add_argument("--only", default=None, help="candidate labels to time (comma-separated)")
    ap.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="compile-ahead processes (0: none)")
    ap.add_argument("--budget-ms", type=float, default=60.0, help="timing budget per cell")
    ap.add_argument("--budget-s", type=float, default=380.0,
                    help="stop starting cases after this many seconds")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run (TRITON_INTERPRET=1): N=64, D=32, H=2, 3 candidates")
    ap.add_argument("--out", default=None, help="JSON lines (default $OUT/bwd_cands.jsonl)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dims = tuple(int(x) for x in args.head_dims.split(","))
    names = set(args.only.split(",")) if args.only else None
    seqlens = tuple(int(x) for x in args.seqlens.split(","))
    window, tokens, hidden = (WINDOW_N, WINDOW_KEYS), grid.TOKENS, grid.HIDDEN
    if args.smoke:  # the D=128 candidates at D=32, interpreter-sized
        CANDIDATES[32] = {k: CANDIDATES[128][k] for k in ("default", "atomic-s3", "fused")}
        dims, seqlens, window, tokens, hidden, args.jobs = (32,), (64,), (64, 16), 64, 64, 0
    cases = make_cases(dims, seqlens, None if args.no_window else window, tokens, hidden)
    spec = chosen(dims, names)
    peer_list = make_peers(spec, with_peers=dev == "cuda")
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench_out"), "bwd_cands.jsonl")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    f = open(out_path, "w")
    env = dict(kind="env", **runner.environment(dev),
               candidates={p.name: {d: v.name for d, v in p.variants.items()}
                           for p in peer_list if isinstance(p, P.Forced)})
    f.write(json.dumps(env) + "\n")
    print(json.dumps(env), flush=True)
    if dev == "cuda" and args.jobs:
        warm_all(cases, spec, args.jobs, 0.55 * args.budget_s)
    rows = []
    for case in cases:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget: {case.label} and later cases not run", flush=True)
            break
        inp = P.make_inputs(case, dev)
        here = [peer for peer in peer_list if runs(case, peer)]
        for peer, row in zip(here, runner.time_cell(case, here, inp, dev, args.budget_ms, False)):
            row["variant"] = _what_ran(case, peer, inp)
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps({k: row.get(k) for k in ("mode", "seqlen_q", "head_dim", "causal",
                                                      "mask", "peer", "ms", "throughput",
                                                      "max_abs_diff", "error", "skipped")}),
                  flush=True)
        del inp
    f.close()
    _table(rows)
    print(f"wall {time.perf_counter() - t0:.0f} s; rows: {out_path}")
    return 0


def _what_ran(case: Case, peer, inp) -> str:
    """The bwd variant the call ran (a window call: the forced variant's window twin)."""
    if not isinstance(peer, P.Flashtune):
        return peer.doc
    import flashtune
    q, k, v = inp.tensors
    kw = grid.MASKS[case.mask].flashtune_kwargs(case) if case.mask else {}
    try:
        with peer.context(case):
            return flashtune.explain(q, k, v, causal=case.causal, family="bwd", **kw).variant.name
    except Exception as e:  # noqa: BLE001
        return f"explain failed: {e!r}"[:200]


def _table(rows: list) -> None:
    from flashtune.bench.report import cases as by_case, geomean
    print(f"\n{'case':44} {'peer':14} {'ms':>8} {'TFLOP/s':>8} {'/flex':>6} {'/disp':>6}")
    ratios: dict = {}
    for _, cells in by_case(rows).items():
        flex, disp = cells.get("flex", {}).get("ms"), cells.get("flashtune", {}).get("ms")
        for name, r in cells.items():
            label = grid.Case(**{f: r[f] for f in ("section", "mode", "batch", "heads",
                                                   "kv_heads", "seqlen_q", "seqlen_k",
                                                   "head_dim", "causal", "dtype", "mask")}).label
            if "ms" not in r:
                print(f"{label:44} {name:14} {r.get('error') or r.get('skipped', '')}"[:140])
                continue
            a = flex / r["ms"] if flex else None
            b = disp / r["ms"] if disp else None
            ratios.setdefault(name, []).append((a, b))
            print(f"{label:44} {name:14} {r['ms']:8.3f} {r['throughput']:8.1f} "
                  f"{a or float('nan'):6.3f} {b or float('nan'):6.3f}")
    print("\nspeed geomean over the cases each ran (>1: faster than flex / than dispatched)")
    for name, xs in ratios.items():
        ga, gb = geomean([a for a, _ in xs]), geomean([b for _, b in xs])
        print(f"  {name:14} vs flex {_fmt(ga)}  vs dispatched {_fmt(gb)}  ({len(xs)} cases)")


def _fmt(x) -> str:
    return "   -  " if x is None or not math.isfinite(x) else f"{x:6.3f}"


if __name__ == "__main__":
    sys.exit(main())
