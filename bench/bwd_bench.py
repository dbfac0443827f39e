"""Backward benchmark: flashtune's two dQ schemes (atomic, separate) beside flashtune as
dispatched and SDPA's flash and cuDNN, on the standard grid; peak memory of forward+backward
beside SDPA's math backend. The dQ-scheme study behind flashtune/defaults.py's BWD_DQ_DEFAULT;
everything else is `flashtune bench --section dense,memory --mode bwd`.

    python3 bench/bwd_bench.py [--quick]     # --quick: D=128, N in 1k/4k
    python3 bench/bwd_bench.py --hopper      # the hopper_bwd family's defaults (Gluon, sm_90)
                                             # beside the generic bwd and SDPA, no memory table
    python3 bench/bwd_bench.py --hopper --flex --seqlens 1024,4096,16384 --only \
        flashtune,flashtune-hopper_bwd,flashtune-hopper_bwd-sepdq,sdpa-cudnn,flex
                                             # a narrower run with compiled Flex beside

Output: $OUT/bwd_bench.json (a `flashtune bench` result: `flashtune bench --from` renders it)
and the tables on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from flashtune.bench import grid, report, runner
from flashtune.bench.peers import Flashtune, Flex, Forced, Sdpa
from flashtune.defaults import default_variant


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="D=128, N in 1k and 4k, one memory row")
    ap.add_argument("--hopper", action="store_true",
                    help="time the hopper_bwd family's defaults (forced) too; dense table only")
    ap.add_argument("--flex", action="store_true", help="FlexAttention (compiled) beside")
    ap.add_argument("--seqlens", default="", help="comma-separated N (default: the standard grid)")
    ap.add_argument("--head-dims", default="", help="comma-separated D (default: 64,128)")
    ap.add_argument("--only", default="", help="comma-separated peer names to keep (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bwd_bench.py needs a CUDA GPU")
    dims = (128,) if args.quick else (64, 128)
    if args.head_dims:
        dims = tuple(int(x) for x in args.head_dims.split(","))
    peers = [Flashtune(True)]
    for dq in ("atomic", "separate"):
        variants = {d: default_variant("bwd", d, "bfloat16", dq=dq) for d in dims}
        peers.append(Forced(f"flashtune-{dq}", variants, f"the built-in bwd default, dQ {dq}"))
    if args.hopper:
        variants = {d: default_variant("hopper_bwd", d, "bfloat16") for d in dims}
        peers.append(Forced("flashtune-hopper_bwd", variants,
                            "the hopper_bwd family's default (Gluon, sm_90), forced"))
        # dK/dV in Gluon, dQ by the generic bwd's dQ kernel (no dQ atomics)
        sep = {d: dataclasses.replace(v, dq="separate") for d, v in variants.items()}
        peers.append(Forced("flashtune-hopper_bwd-sepdq", sep,
                            "hopper_bwd's default with dq=separate (the generic dQ kernel), "
                            "forced"))
    peers += [Sdpa("flash"), Sdpa("cudnn")] + ([] if args.hopper else [Sdpa("math")])
    if args.flex:
        peers.append(Flex())
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {p.name for p in peers}
        if unknown:
            sys.exit(f"--only: no peer named {', '.join(sorted(unknown))} "
                     f"(peers: {', '.join(p.name for p in peers)})")
        peers = [p for p in peers if p.name in keep]
    sections = ("dense",) if args.hopper else ("dense", "memory")
    shapes = grid.Shapes(head_dims=dims, modes=("bwd",),
                         seqlens=(tuple(int(x) for x in args.seqlens.split(",")) if args.seqlens
                                  else (1024, 4096) if args.quick else grid.SEQLENS),
                         memory_seqlens=(4096,) if args.quick else (2048, 4096, 8192, 16384))
    out = Path(os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    doc = runner.run(shapes, sections, peers, "cuda",
                     checkpoint=out / "bwd_bench.json",
                     command="python3 bench/bwd_bench.py " + " ".join(sys.argv[1:]))
    print(report.markdown(doc, title="bench/bwd_bench.py"))
    print("results:", out / "bwd_bench.json")


if __name__ == "__main__":
    main()
