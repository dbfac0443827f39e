"""hopper_fwd's block-sparse render on the GPU (issue 11): a random 128 x 128 block pattern (the
diagonal kept, mask_bench.random_blocks) at several densities, timed for the Hopper Gluon family
forced (its D=128 default), the generic fwd family as dispatched for the block-sparse call
(explain() names its variant in each row), and FlexAttention (torch.compile'd flex_attention,
create_block_mask of a mask_mod reading the same pattern: every kept block full, as flashtune's).

    python3 bench/hopper_sparse_bench.py             # N=4k,16k x density 10,30,60,100 %, D=128,
                                                     # bf16, B=1, H=16 (STEPS=hopperblocksparse)
    python3 bench/hopper_sparse_bench.py --bwd       # the backward: hopper_bwd forced vs the
                                                     # generic bwd as dispatched vs Flex
                                                     # (STEPS=hopperbwdblocksparse)
    TRITON_INTERPRET=1 python3 bench/hopper_sparse_bench.py --smoke   # CPU: imports, rows, table

One JSON line per (N, density, impl) to $OUT/hopper_sparse.jsonl (--out): ms (median of
do_bench, L2 flushed), TFLOP/s = 4*B*H*D*(kept blocks' pairs) / t, the variant that ran, max
|O - O_fwd| against the generic family's output (a sanity check; the tests hold every kernel to the
float64 reference). Per N a dense row (no mask, each family forced or dispatched) sets the
"x dense" column. A table and the geomean ratios (hopper / fwd, hopper / flex) per N close it.
--bwd times the backward alone (hopper_mask_bench.backward_rows: TFLOP/s 2.5 x the forward's)
for hopper_bwd's D=128 default forced, the generic bwd as dispatched and Flex, to
$OUT/hopper_bwd_sparse.jsonl.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import flashtune  # noqa: E402
from hopper_mask_bench import backward_rows, forced_forward, forward_rows, open_rows  # noqa: E402
from mask_bench import flex_fn, random_blocks  # noqa: E402

HOPPER = "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24"  # the D=128 default
HOPPER_BWD = "hopper_bwd-m64-n128-w8-s2"  # hopper_bwd's D=128 default (--bwd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="4096,16384", help="sequence lengths (Nq = Nk)")
    ap.add_argument("--densities", default="10,30,60,100", help="percent of 128 x 128 blocks kept")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hopper", default=None,
                    help=f"the variant forced (default {HOPPER}, --bwd: {HOPPER_BWD})")
    ap.add_argument("--bwd", action="store_true",
                    help="time the backward: hopper_bwd forced vs the generic bwd vs Flex")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run (TRITON_INTERPRET=1): N=256, D=64, H=2, density 50")
    ap.add_argument("--out", default=None, help="JSON lines (default $OUT/hopper_sparse.jsonl)")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.n, args.densities, args.heads, args.head_dim, args.no_flex = "256", "50", 2, 64, True
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    args.hopper = args.hopper or (HOPPER_BWD if args.bwd else HOPPER)
    mine, base = ("hopper_bwd", "bwd") if args.bwd else ("hopper", "fwd")
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench_out"),
                                        "hopper_bwd_sparse.jsonl" if args.bwd else
                                        "hopper_sparse.jsonl")
    f = open_rows(out_path, dev, dt, args, hopper=args.hopper, bwd=args.bwd)
    rows = []
    b, h, d = args.batch, args.heads, args.head_dim

    for n in (int(x) for x in args.n.split(",")):
        q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt) for _ in range(3))
        nb = -(-n // 128)
        blocks_now = torch.zeros(nb, nb, dtype=torch.bool, device=dev)  # Flex's mask_mod reads it

        def kept(bb, hh, qi, ki):
            return blocks_now[qi // 128, ki // 128]
        for pct in ["dense"] + [int(p) for p in args.densities.split(",")]:
            kw, pairs = {}, float(n * n)
            if pct != "dense":
                blocks = random_blocks(nb, pct / 100, seed=pct).to(dev)
                bm = flashtune.BlockMask.from_dense(blocks, (n, n), block_size=128)
                kw, pairs = dict(block_mask=bm), bm.density() * n * n
            impls = {base: (None, lambda q, k, v, kw=kw: flashtune.attention(q, k, v, **kw)),
                     mine: (args.hopper, forced_forward(args.hopper, kw))}
            if not args.no_flex and pct != "dense":
                try:
                    from torch.nn.attention.flex_attention import create_block_mask
                    blocks_now.copy_(blocks)
                    fbm = create_block_mask(kept, None, None, n, n, device=dev, BLOCK_SIZE=128)
                    impls["flex"] = ("flex_attention (compiled)", flex_fn(fbm))
                except Exception as e:  # noqa: BLE001 -- no Flex here: rows without it
                    print(f"flex N={n} {pct}%: {e!r}", flush=True)
            rows += (backward_rows if args.bwd else forward_rows)(
                f, q, k, v, kw, impls, pairs, kind="density_bwd" if args.bwd else "density", N=n,
                density=pct)
    f.close()
    _table(rows, mine, base)
    return 0


def _table(rows, mine="hopper", base="fwd") -> None:
    dense = {(r["N"], r["impl"]): r["ms"] for r in rows if r["density"] == "dense" and "ms" in r}
    print(f"\n{'N':>6} {'dens%':>6} {'impl':8} {'ms':>8} {'TFLOP/s':>8} {'x dense':>8}  variant")
    for r in rows:
        if "ms" not in r:
            print(f"{r['N']:6} {str(r['density']):>6} {r['impl']:10} error "
                  f"{r.get('error', '')[:60]}")
            continue
        ref = dense.get((r["N"], r["impl"])) or dense.get((r["N"], base))
        x = f"{r['ms'] / ref:8.3f}" if ref else f"{'':8}"
        print(f"{r['N']:6} {str(r['density']):>6} {r['impl']:10} {r['ms']:8.3f} "
              f"{r['tflops']:8.1f} {x}  {r.get('variant', '')}")
    by = {(r["N"], r["density"], r["impl"]): r["ms"] for r in rows
          if "ms" in r and r["density"] != "dense"}
    for n in sorted({r["N"] for r in rows}):
        for peer in (base, "flex"):
            xs = [by[(n, p, peer)] / by[(n, p, mine)] for (nn, p, i) in by
                  if nn == n and i == mine and (n, p, peer) in by]
            if xs:
                g = math.exp(sum(map(math.log, xs)) / len(xs))
                print(f"N={n}: {mine} speed / {peer}: geomean {g:.3f}x over {len(xs)} densities")


if __name__ == "__main__":
    sys.exit(main())
