"""Masks beyond causal on the GPU (issue 11): time against window size and against block density,
beside FlexAttention compiled with the same mask and SDPA with an explicit mask.

    python3 bench/mask_bench.py                 # N=16k, B=1, H=16, D=128, bf16: the issue's grid
    python3 bench/mask_bench.py --quick         # N=4k, a few points (smoke run)
    python3 bench/mask_bench.py --bwd           # also fwd+bwd rows
    TRITON_INTERPRET=1 python3 bench/mask_bench.py --smoke --no-peers   # CPU smoke run

Rows (one JSON line each, a table at the end), forward ("fwd") and with --bwd "fwd+bwd":
  dense      flashtune.attention without a mask (before/after: compare with fwd_bench's dense
             rows and with a checkout before the masks; the dense kernels' code is unchanged, so
             this should match within noise, +-2%)
  window W   flashtune.attention(window=(W, 0), causal=True) for W in 128 .. N (Mistral-style);
             peers: flex (flex_attention compiled, create_block_mask of the same sliding window),
             sdpa (scaled_dot_product_attention with the explicit boolean mask: the efficient or
             math backend; skipped where the N x N mask does not fit)
  density p  flashtune.attention(block_mask=BlockMask.from_dense(random blocks, p)) for p in
             5 .. 100 % (128 x 128 blocks, the same random pattern for every peer; the diagonal
             block always kept so no row is empty); flex with create_block_mask of a mask_mod
             reading that block pattern (every kept block full); sdpa with the element mask
On the GPU flashtune and Flex are re-timed interleaved on each mask (--rounds shuffled rounds,
flashtune.timing.interleaved, each row with its spread); SDPA and the dense rows by do_bench.
--graph: each of those calls (flashtune's and Flex's, forward or forward + backward) is captured
in a CUDA graph after its warm-up and the replays are timed: the GPU's time without the host's
launches, which at N=4k, B=1 moved whole fwd+bwd steps 2x between machine starts for both sides
(docs/benchmarks.md, sessions 12 and 16). Rows then say timing "graph, interleaved xR".
Targets (issue 11): 10 %-dense <= 0.15x the dense time at N=16k; at or above FlexAttention.
FLOPs for TFLOP/s: 4*B*H*D*(visible pairs) (fwd; bwd 2.5x): dense N^2 (causal N^2/2), window
sum over rows of the keys it sees, block density p * N^2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import flashtune  # noqa: E402
from flashtune.masks import dense_mask, window_keys  # noqa: E402


def bench_ms(fn, warmup=10, rep=50) -> float:
    if not torch.cuda.is_available():  # a smoke run in Triton's interpreter: one timed call
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fwd_bwd(fn, q, k, v):
    """fn(q, k, v) -> out; returns a callable doing forward + backward on one upstream grad."""
    do = torch.randn_like(q)

    def run():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)
    return run


_flex = None


def flex_fn(block_mask):
    """flex_attention compiled once per process: the block masks are its inputs, and the mask_mods
    below read their parameter from one tensor updated in place, so no point recompiles."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: _flex(q, k, v, block_mask=block_mask)


def sdpa_fn(mask):
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                             attn_mask=mask)


def random_blocks(nb: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(nb, nb, generator=g) < density
    blocks |= torch.eye(nb, dtype=torch.bool)
    return blocks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--windows", default="128,256,512,1024,2048,4096,8192,16384",
                    help="comma-separated; \"none\" skips the window sweep")
    ap.add_argument("--densities", default="5,10,20,30,50,75,100",
                    help="percent, comma-separated; \"none\" skips the density sweep")
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward")
    ap.add_argument("--quick", action="store_true", help="N=4096, three points per sweep")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--sdpa-max-n", type=int, default=16384,
                    help="largest N for the SDPA peer (its N x N mask is materialized)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run in Triton's interpreter (TRITON_INTERPRET=1): N=256")
    ap.add_argument("--out", default=None, help="JSON lines (default $OUT/mask_bench.jsonl)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of flashtune and Flex per mask (GPU)")
    ap.add_argument("--graph", action="store_true",
                    help="time flashtune's and Flex's calls as CUDA graph replays (GPU)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.windows, args.densities = 4096, "128,1024,4096", "10,50,100"
    if args.smoke:
        args.n, args.heads, args.head_dim = 256, 2, 32
        args.windows, args.densities = "128", "50"
    import os
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench_out"), "mask_bench.jsonl")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    f = open(out_path, "w")
    rows = []

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, h, n, d = args.batch, args.heads, args.n, args.head_dim
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=args.bwd)
               for _ in range(3))
    modes = ["fwd"] + (["fwd+bwd"] if args.bwd else [])

    def emit(kind, param, impl, mode, pairs, ms=None, error=None, **extra):
        """One result row (a timing, or the error that kept a peer from running): kept for the
        table, written and printed."""
        row = dict(kind=kind, param=param, impl=impl, mode=mode)
        if error is not None:
            row["error"] = error
        else:
            flops = 4.0 * b * h * d * pairs * (1 if mode == "fwd" else 3.5)
            row.update(ms=ms, tflops=flops / ms / 1e9, **extra)
        rows.append(row)
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(json.dumps(row), flush=True)

    def record(kind, param, impl, fn, pairs):
        for mode in modes:
            try:
                run = (lambda: fn(q, k, v)) if mode == "fwd" else fwd_bwd(fn, q, k, v)
                with torch.no_grad() if mode == "fwd" else contextlib.nullcontext():
                    ms = bench_ms(run)
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run is a row with why
                emit(kind, param, impl, mode, pairs, error=repr(e)[:200])
            else:
                emit(kind, param, impl, mode, pairs, ms)

    def record_together(kind, param, impls, pairs):
        """flashtune and Flex on one mask, re-timed interleaved in shuffled rounds on the GPU
        (flashtune.timing.interleaved: drift hits both alike; single do_bench medians of a
        fwd+bwd step moved 15-50% between runs, H100, 16k), each row with its rounds' spread."""
        if dev != "cuda":
            for impl, fn in impls:
                record(kind, param, impl, fn, pairs)
            return
        from flashtune.timing import interleaved
        for mode in modes:
            runs, names = [], []
            for impl, fn in impls:
                run = (lambda fn=fn: fn(q, k, v)) if mode == "fwd" else fwd_bwd(fn, q, k, v)
                try:
                    with torch.no_grad() if mode == "fwd" else contextlib.nullcontext():
                        run()
                except Exception as e:  # noqa: BLE001 -- a peer that cannot run: a row
                    emit(kind, param, impl, mode, pairs, error=repr(e)[:200])
                    continue
                if mode == "fwd":
                    def run(run=run):
                        with torch.no_grad():
                            run()
                if args.graph:
                    # flashtune.timing.graphed: a forward + backward's autograd runs inside the
                    # capture; a call that cannot be captured comes back as itself: a row
                    # with why, not a plain timing passed off as a graph's
                    from flashtune.timing import graphed
                    captured = graphed(run)
                    if captured is run:
                        emit(kind, param, impl, mode, pairs, error="graph: not capturable")
                        continue
                    run = captured
                runs.append(run)
                names.append(impl)
            # ~100 ms of each first: Flex compiles per mask, and a GPU left idle through it
            # clocks down (the 4k 10% mask right after its compile read 2.5 / 1.3 ms for
            # flashtune / Flex fwd+bwd, spreads 0.66 / 0.43, against 0.71 / 0.74 at 50%)
            for run in runs:
                t_end = time.perf_counter() + 0.1
                while time.perf_counter() < t_end:
                    run()
                    torch.cuda.synchronize()
            for impl, (ms, spread) in zip(names, interleaved(runs, rounds=args.rounds)):
                emit(kind, param, impl, mode, pairs, ms, spread=round(spread, 3),
                     timing=("graph, " if args.graph else "") + f"interleaved x{args.rounds}")

    import triton
    env = dict(kind="env", torch=torch.__version__, triton=triton.__version__,
               device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               N=n, B=b, H=h, D=d, dtype="bfloat16")
    f.write(json.dumps(env) + "\n")
    print(env)

    # dense baselines (the dense path must be unchanged)
    record("dense", "full", "flashtune", lambda q, k, v: flashtune.attention(q, k, v), n * n)
    record("dense", "causal", "flashtune",
           lambda q, k, v: flashtune.attention(q, k, v, causal=True), n * n / 2)

    # window sweep: causal sliding window of W keys back (Mistral)
    w_now = torch.zeros((), dtype=torch.int64, device=dev)  # the Flex mask_mod's W

    def sliding(bb, hh, qi, ki):
        return (qi >= ki) & (qi - ki <= w_now)
    for w in (int(x) for x in args.windows.split(",") if x.isdigit() and int(x) <= n):
        pairs = window_keys(n, n, True, (w, 0)) * n
        impls = [("flashtune", lambda q, k, v, w=w: flashtune.attention(q, k, v, causal=True,
                                                                         window=(w, 0)))]
        if not args.no_peers:
            try:
                from torch.nn.attention.flex_attention import create_block_mask
                w_now.fill_(w)
                fbm = create_block_mask(sliding, None, None, n, n, device=dev)
                impls.append(("flex", flex_fn(fbm)))
            except Exception as e:  # noqa: BLE001
                print(f"flex window {w}: {e!r}")
        record_together("window", w, impls, pairs)
        if not args.no_peers and n <= args.sdpa_max_n:
            m = dense_mask(n, n, True, (w, 0), device=dev)
            record("window", w, "sdpa", sdpa_fn(m), pairs)

    # density sweep: random 128 x 128 blocks
    nb = -(-n // 128)
    blocks_now = torch.zeros(nb, nb, dtype=torch.bool, device=dev)  # the Flex mask_mod's blocks

    def kept(bb, hh, qi, ki):
        return blocks_now[qi // 128, ki // 128]
    for pct in (int(x) for x in args.densities.split(",") if x.isdigit()):
        blocks = random_blocks(nb, pct / 100, seed=pct).to(dev)
        bm = flashtune.BlockMask.from_dense(blocks, (n, n), block_size=128)
        pairs = bm.density() * n * n
        impls = [("flashtune", lambda q, k, v, bm=bm: flashtune.attention(q, k, v, block_mask=bm))]
        if not args.no_peers:
            try:
                from torch.nn.attention.flex_attention import create_block_mask
                blocks_now.copy_(blocks)
                # the block pattern as a mask_mod: create_block_mask finds every kept block full
                # (the mask is constant inside it), so Flex skips mask_mod there, as flashtune
                # does
                fbm = create_block_mask(kept, None, None, n, n, device=dev, BLOCK_SIZE=128)
                impls.append(("flex", flex_fn(fbm)))
            except Exception as e:  # noqa: BLE001
                print(f"flex density {pct}: {e!r}")
        record_together("density", pct, impls, pairs)
        if not args.no_peers and n <= args.sdpa_max_n:
            record("density", pct, "sdpa", sdpa_fn(bm.to_dense_mask()), pairs)

    # table: time relative to flashtune's dense forward
    dense = {r["mode"]: r["ms"] for r in rows if r["kind"] == "dense" and r["param"] == "full"
             and "ms" in r}
    print(f"\n{'kind':8} {'param':>6} {'impl':10} {'mode':8} {'ms':>9} {'TFLOP/s':>8} "
          f"{'x dense':>8}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['kind']:8} {str(r['param']):>6} {r['impl']:10} {r['mode']:8} "
                  f"error {r['error'][:60]}")
            continue
        print(f"{r['kind']:8} {str(r['param']):>6} {r['impl']:10} {r['mode']:8} "
              f"{r['ms']:9.3f} {r['tflops']:8.1f} {r['ms'] / dense[r['mode']]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
