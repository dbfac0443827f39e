"""Which part of hopper_bwd's step bounds it (issue 10: the D=256 backward at 0.67-0.94x cuDNN,
docs/hopper.md "The backward's dQ atomics"): variants and ablated renders of them, each
backward split per kernel by the CUDA profiler.

Ablations -- edits of a variant's rendered source made only in this script's processes, never
shipped or searched:
  none        the variant as rendered
  no-atomics  dQ's atomic adds become stores masked off at run time (`sm_scale < 0`, which the
              compiler cannot know), so dQ's wgmmas still run and nothing reaches memory: what
              the atomics cost the kernel. Its dQ is wrong; nothing checks it here.
A dq="separate" variant gives the dK/dV kernel without dQ's product or atomics, with the generic
dQ kernel beside it; dq="gluon" the same dK/dV kernel with the template's Gluon dQ kernel.

Each (variant, ablation) runs in its own process (a variant's module is memoized by its fields,
so an ablated render needs a fresh one): the forward once, then the backward on that graph,
3 calls of warm-up and --calls under torch.profiler; the kernels' times are summed per name and
divided by the calls. One JSON line per (case, variant, ablation) in --out, a table last:
ms per call of each kernel and of the whole backward, and the backward's TFLOP/s (2.5x the
forward's FLOPs, halved for causal).

    python3 bench/bwd_ablation.py --d 256 --n 4096,16384 --causal 0,1
    python3 bench/bwd_ablation.py --d 256 --variants hopper_bwd-m64-n64-w8-s2-dq_overlap=true
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # the H100 table's records, with dq_overlap, and dQ by a separate kernel
    256: ["hopper_bwd-m64-n64-w8-s2", "hopper_bwd-m64-n64-w8-s2-dq_overlap=true",
          "hopper_bwd-m64-n64-w8-s2-dq=separate", "hopper_bwd-m64-n64-w8-s2-dq=gluon"],
    128: ["hopper_bwd-m64-n128-w8-s1", "hopper_bwd-m64-n128-w8-s1-dq_overlap=true",
          "hopper_bwd-m64-n128-w8-s1-dq=separate", "hopper_bwd-m64-n128-w8-s2-dq=gluon"],
    64: ["hopper_bwd-m64-n128-w8-s2", "hopper_bwd-m64-n128-w8-s2-dq_overlap=true",
         "hopper_bwd-m64-n128-w8-s2-dq=gluon"],
}
# (old, new) text edits per ablation; each must match in every render it is applied to
EDITS = {
    "no-atomics": (("gl.atomic_add(", "gl.store("),
                   ('mask=in_rows, sem="relaxed")', "mask=in_rows & (sm_scale < 0))")),
}


def ablated_source(src: str, ablation: str) -> str:
    """`src` with the ablation's edits; a ValueError where one does not match (so an ablation
    can never time the unedited kernel under its name)."""
    for old, new in EDITS.get(ablation, ()):
        if old not in src:
            raise ValueError(f"ablation {ablation!r}: {old!r} is not in the render")
        src = src.replace(old, new)
    return src


def _patch_render(ablation: str) -> None:
    """Make the kernel cache write (and import) the ablated source of every hopper_bwd render."""
    from flashtune.codegen import cache
    plain = cache.render

    def render(variant, interpret=False):
        src = plain(variant, interpret)
        return ablated_source(src, ablation) if variant.family == "hopper_bwd" else src
    cache.render = render


def child(name: str, ablation: str, d: int, n: int, causal: bool, calls: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import flashtune
    from flashtune.codegen import Variant
    if ablation != "none":
        _patch_render(ablation)
    b, h = max(1, 16384 // n), 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    with flashtune.force(Variant.parse(name)):
        o = flashtune.attention(q, k, v, causal=causal)

        def bwd():
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        for _ in range(3):
            bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                bwd()
            torch.cuda.synchronize()
    kernels: dict = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:60]] += e.device_time / 1000.0 / calls  # us -> ms per call
    total = sum(kernels.values())
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    return dict(variant=name, ablation=ablation, d=d, n=n, causal=causal, ms=total,
                tflops=flops / total / 1e9 if total else None,
                kernels={k: round(t, 4) for k, t in sorted(kernels.items(), key=lambda x: -x[1])})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", default="256", help="head dims (comma-separated)")
    ap.add_argument("--n", default="4096", help="sequence lengths (B*N = 16k, H = 2048 / D)")
    ap.add_argument("--causal", default="0", help="0, 1 or 0,1")
    ap.add_argument("--variants", default=None, help="instead of VARIANTS[d] (comma-separated)")
    ap.add_argument("--ablations", default="none,no-atomics")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
    ap.add_argument("--out", default=None, help="JSON lines (default $OUT/bwd_ablation.jsonl)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        name, ablation, d, n, causal = args.child.split("|")
        print(json.dumps(child(name, ablation, int(d), int(n), causal == "1", args.calls)))
        return 0
    out = Path(args.out or os.path.join(os.environ.get("OUT", "bench_out"), "bwd_ablation.jsonl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with out.open("w") as f:
        for d in (int(x) for x in args.d.split(",")):
            names = args.variants.split(",") if args.variants else VARIANTS[d]
            for n in (int(x) for x in args.n.split(",")):
                for c in args.causal.split(","):
                    for name in names:
                        for abl in args.ablations.split(","):
                            if abl != "none" and ("separate" in name or "gluon" in name):
                                continue  # no atomics to take out
                            spec = f"{name}|{abl}|{d}|{n}|{c}"
                            try:
                                r = subprocess.run(
                                    [sys.executable, __file__, "--child", spec,
                                     "--calls", str(args.calls)], capture_output=True,
                                    text=True, timeout=args.timeout)
                                line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
                                row = (json.loads(line) if line.startswith("{") else
                                       dict(spec=spec, error=r.stderr.strip()[-400:]))
                            except subprocess.TimeoutExpired:
                                row = dict(spec=spec, error=f"timeout {args.timeout} s")
                            rows.append(row)
                            f.write(json.dumps(row) + "\n")
                            f.flush()
                            print(json.dumps(row), flush=True)
    print(f"\n{'variant':48s} {'ablation':11s} {'D':>4s} {'N':>6s} {'c':>2s} {'ms':>8s} "
          f"{'TFLOP/s':>8s}  kernels (ms)")
    for r in rows:
        if "error" in r:
            print(f"{r['spec']}: {r['error'][-160:]}")
            continue
        ks = ", ".join(f"{k.split('(')[0][:24]} {t:.3f}" for k, t in list(r["kernels"].items())[:4])
        print(f"{r['variant']:48s} {r['ablation']:11s} {r['d']:4d} {r['n']:6d} "
              f"{int(r['causal']):2d} {r['ms']:8.3f} {r['tflops'] or 0:8.1f}  {ks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
