"""Split-KV tile/split sweep on a few decode shapes, with SDPA's cuDNN backend in the same run:
what the decode defaults and the auto split rule should be, and what the programmatic dependent
launch of the combine saves. Times SplitKVPlan.run alone (no API validation) as CUDA-graph
replays (L2 flushed by do_bench between replays), as bench/decode_bench.py --graph does.

    python bench/decode_sweep.py --out sweep.jsonl            # the sweep
    ncu ... python bench/decode_sweep.py --ncu                # one call of each, for a profiler
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import time

import torch
import triton

from flashtune.bench.timing import graphed
from flashtune.codegen import Variant
from flashtune.launch_splitkv import MAX_SPLITS, SplitKVPlan

# (label, Hq, Hk, B, Nk, page): the shapes the targets are missed on
SHAPES = [
    ("gqa-b1-32k", 32, 8, 1, 32768, None),
    ("gqa-b1-128k", 32, 8, 1, 131072, None),
    ("gqa-b1-8k", 32, 8, 1, 8192, None),
    ("mqa-b1-32k", 8, 1, 1, 32768, None),
    ("gqa-b8-32k", 32, 8, 8, 32768, None),
    ("gqa-b32-32k", 32, 8, 32, 32768, None),
    ("gqa-b32-32k-paged256", 32, 8, 32, 32768, 256),
    ("mqa-b32-32k", 8, 1, 32, 32768, None),
    ("gqa-b64-8k", 32, 8, 64, 8192, None),
    ("mqa-b8-8k", 8, 1, 8, 8192, None),
    ("gqa-b64-32k", 32, 8, 64, 32768, None),
    ("gqa-b64-32k-paged64", 32, 8, 64, 32768, 64),
    ("mqa-b64-32k-paged64", 8, 1, 64, 32768, 64),
    ("gqa-b8-32k-paged64", 32, 8, 8, 32768, 64),
    ("gqa-b1-32k-paged64", 32, 8, 1, 32768, 64),
]
D = 128


def graph_ms(fn) -> float:
    return triton.testing.do_bench(graphed(fn), warmup=20, rep=80, return_mode="median")


def make(hq, hk, b, nk, page):
    q = torch.randn(b, 1, hq, D, dtype=torch.bfloat16, device="cuda")
    kc = torch.randn(b, nk, hk, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    seqlens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
    bt = None
    if page:
        kc, vc = kc.view(-1, page, hk, D), vc.view(-1, page, hk, D)
        bt = torch.randperm(kc.shape[0], device="cuda").to(torch.int32).view(b, nk // page)
    return q, kc, vc, seqlens, bt


def cudnn(q, kc, vc, page):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if page:
        return None
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    return run


def splits_for(hk, b, sms=132):
    """Split counts that fill 0.5, 1, 1.5, 2, 3, 4 waves of the SMs."""
    programs = b * hk
    return sorted({max(1, round(w * sms / programs)) for w in (0.5, 1, 1.5, 2, 3, 4)})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="decode_sweep.jsonl")
    ap.add_argument("--ncu", action="store_true", help="run each default and cuDNN a few times")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--shapes", default="", help="comma-separated labels to run (default: all)")
    args = ap.parse_args(argv)
    shapes = [sh for sh in SHAPES if not args.shapes or sh[0] in args.shapes.split(",")]
    t0 = time.time()
    out = open(args.out, "w")
    base = Variant("splitkv", block_m=64, block_n=64, num_warps=4, num_stages=3)
    for label, hq, hk, b, nk, page in shapes:
        q, kc, vc, seqlens, bt = make(hq, hk, b, nk, page)
        kv_bytes = 2.0 * b * hk * nk * D * 2
        if args.ncu:
            plan = SplitKVPlan(q, kc, False, None, dataclasses.replace(base, paged=bool(page)))
            for _ in range(3):
                plan.run(q, kc, vc, seqlens, bt, nk)
            peer = cudnn(q, kc, vc, page)
            for _ in range(3 if peer else 0):
                peer()
            torch.cuda.synchronize()
            continue
        peer = cudnn(q, kc, vc, page)
        if peer is not None:
            ms = graph_ms(peer)
            out.write(json.dumps({"shape": label, "impl": "cudnn", "ms": ms,
                                  "gbps": kv_bytes / ms / 1e6}) + "\n")
            print(f"{label:24s} cudnn {kv_bytes / ms / 1e6:7.0f} GB/s", flush=True)
        grid = [g for g in itertools.product([32, 64, 128] if not page else [32, 64], [2, 3, 4], [4], ["pointer", "descriptor"],
                                             splits_for(hk, b) + [0], [True])]
        grid = [g for g in grid if g[4] <= MAX_SPLITS]
        # the default tile (auto splits) with and without PDL first, the rest in random order
        # so a budget cut still samples every axis
        first = [(64, 3, 4, "pointer", 0, True), (64, 3, 4, "pointer", 0, False)]
        random.Random(0).shuffle(grid)
        grid = first + [g for g in grid if g not in first]
        best = None
        t_shape = time.time()
        for bn, st, w, loads, ns, pdl in grid:
            if time.time() - t_shape > args.budget / len(shapes):
                break
            v = Variant("splitkv", block_m=64, block_n=bn, num_warps=w, num_stages=st,
                        loads=loads, num_splits=ns, paged=bool(page))
            try:
                plan = SplitKVPlan(q, kc, False, None, v)
                if not pdl:
                    plan.pdl = False
                    plan.kwargs["USE_PDL"] = False
                ms = graph_ms(lambda: plan.run(q, kc, vc, seqlens, bt, nk))
                row = {"shape": label, "impl": "flashtune", "variant": v.name, "block_n": bn,
                       "stages": st, "warps": w, "loads": loads, "num_splits": ns,
                       "splits_run": plan.num_splits(nk), "pdl": pdl, "ms": ms,
                       "gbps": kv_bytes / ms / 1e6}
                if best is None or ms < best["ms"]:
                    best = row
            except Exception as e:  # noqa: BLE001 -- an infeasible config is a row
                row = {"shape": label, "impl": "flashtune", "variant": v.name, "pdl": pdl,
                       "error": f"{type(e).__name__}: {str(e)[:160]}"}
            out.write(json.dumps(row) + "\n")
            out.flush()
        if best:
            print(f"{label:24s} best {best['gbps']:7.0f} GB/s {best['variant']} "
                  f"splits={best['splits_run']} pdl={best['pdl']}", flush=True)
        del q, kc, vc
        torch.cuda.empty_cache()
    print(f"sweep {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
