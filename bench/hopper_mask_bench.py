"""hopper_fwd's masked renders on the GPU (issue 11): the causal sliding-window forward, timed for
the Hopper Gluon family forced (its D=128 default and a no-loader ping-pong schedule), the generic
fwd family as dispatched for the masked call (its tuned or built-in window variant; explain()
names it in each row), and FlexAttention (torch.compile'd flex_attention, create_block_mask of
the same window).

    python3 bench/hopper_mask_bench.py                # N=4k,16k x W=256..4096, causal, D=128,
                                                      # bf16, B=1, H=16 (STEPS=hoppermasks)
    python3 bench/hopper_mask_bench.py --softcap 50   # the same with Gemma 2's softcap
    python3 bench/hopper_mask_bench.py --bwd          # the backward: hopper_bwd forced vs the
                                                      # generic bwd as dispatched vs Flex
                                                      # (STEPS=hopperbwdmasks)
    TRITON_INTERPRET=1 python3 bench/hopper_mask_bench.py --smoke   # CPU: imports, rows, table

window=(W, 0) with causal=True: each query sees itself and the W keys before it (flash_attn's
window_size); Flex's mask_mod is (q >= k) & (q - k <= W). One JSON line per (N, W, impl) to
$OUT/hopper_masks.jsonl (--out): ms (median of do_bench, L2 flushed), TFLOP/s = 4*B*H*D*(pairs
seen) / t, the variant that ran, and max |O - O_fwd| against the generic family's output (each
impl's sanity; the tests hold every kernel to the float64 reference). A table and the geomean
ratios (hopper / fwd, hopper / flex) per N close the run.

--bwd times the backward alone: each impl's forward is run once with gradients (hopper_bwd forced
around it, so its backward runs the masked hopper_bwd twin: ops carries the forced variant over;
the generic bwd as dispatched for the masked call; Flex compiled), then
torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) is timed. TFLOP/s = 2.5 x the
forward's; maxdiff_vs_bwd is max |dQ, dK, dV - the generic bwd's|. Rows go to
$OUT/hopper_bwd_masks.jsonl; the geomeans compare hopper_bwd with "bwd" and "flex".
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import flashtune  # noqa: E402
from flashtune.masks import window_keys  # noqa: E402
from mask_bench import bench_ms  # noqa: E402

# the D=128 default (ping-pong, persistent, loader warp) and the no-loader ping-pong with 128-key
# steps (spill-free at D=128 with a window and softcap: `flashtune kernels check`)
HOPPER = {"hopper": "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24",
          "hopper_noloader": "hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true"}
# --bwd: hopper_bwd's D=128 default (two warpgroups, 128 keys per program) and one warpgroup
# with 64 keys (fewer spills with a window or softcap at D=128: `flashtune kernels check`)
HOPPER_BWD = {"hopper_bwd": "hopper_bwd-m64-n128-w8-s2",
              "hopper_bwd_w4": "hopper_bwd-m64-n64-w4-s2"}


class Flex:
    """flex_attention compiled once per N (dynamic=False); the window is read from one tensor
    updated in place, so the block masks change and the compiled kernel does not."""

    def __init__(self, device):
        from torch.nn.attention.flex_attention import flex_attention
        self.fn = torch.compile(flex_attention, dynamic=False)
        self.w = torch.zeros((), dtype=torch.int64, device=device)

    def call(self, n, w, device, softcap=None):
        from torch.nn.attention.flex_attention import create_block_mask
        self.w.fill_(w)
        cap = self.w

        def sliding(b, h, qi, ki):
            return (qi >= ki) & (qi - ki <= cap)
        bm = create_block_mask(sliding, None, None, n, n, device=device)
        if softcap is None:
            return lambda q, k, v: self.fn(q, k, v, block_mask=bm)

        def capped(score, b, h, qi, ki):  # score = scale * q.k, as flashtune's softcap takes it
            return softcap * torch.tanh(score / softcap)
        return lambda q, k, v: self.fn(q, k, v, score_mod=capped, block_mask=bm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="4096,16384", help="sequence lengths (Nq = Nk)")
    ap.add_argument("--windows", default="256,512,1024,2048,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--softcap", type=float, default=None, help="also cap the scores (Gemma 2: 50)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--bwd", action="store_true",
                    help="time the backward: hopper_bwd forced vs the generic bwd vs Flex")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run (TRITON_INTERPRET=1): N=192, D=64, H=2, W=64")
    ap.add_argument("--out", default=None, help="JSON lines (default $OUT/hopper_masks.jsonl)")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.n, args.windows, args.heads, args.head_dim, args.no_flex = "192", "64", 2, 64, True
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    out_path = args.out or os.path.join(os.environ.get("OUT", "bench_out"),
                                        "hopper_bwd_masks.jsonl" if args.bwd else
                                        "hopper_masks.jsonl")
    f = open_rows(out_path, dev, dt, args, softcap=args.softcap, bwd=args.bwd)
    rows = []
    b, h, d = args.batch, args.heads, args.head_dim
    for n in (int(x) for x in args.n.split(",")):
        q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt) for _ in range(3))
        flex = None
        if not args.no_flex:
            try:
                flex = Flex(dev)
            except Exception as e:  # noqa: BLE001 -- no Flex here: rows without it
                print(f"flex unavailable: {e!r}", flush=True)
        for w in (int(x) for x in args.windows.split(",") if int(x) < n):
            kw = dict(causal=True, window=(w, 0), softcap=args.softcap)
            if args.bwd:
                rows += _bwd_rows(f, q, k, v, n, w, kw, flex, dev, args)
                continue
            pairs = window_keys(n, n, True, (w, 0)) * n
            impls = {"fwd": (None, lambda q, k, v, kw=kw: flashtune.attention(q, k, v, **kw))}
            for name, variant in HOPPER.items():
                def run(q, k, v, kw=kw, variant=variant):
                    with flashtune.force(variant):
                        return flashtune.attention(q, k, v, **kw)
                impls[name] = (variant, run)
            if flex is not None:
                try:
                    impls["flex"] = ("flex_attention (compiled)",
                                     flex.call(n, w, dev, args.softcap))
                except Exception as e:  # noqa: BLE001
                    print(f"flex N={n} W={w}: {e!r}", flush=True)
            rows += forward_rows(f, q, k, v, kw, impls, pairs, kind="window", N=n, W=w,
                                 causal=True, softcap=args.softcap)
    f.close()
    _table(rows, HOPPER_BWD if args.bwd else HOPPER, ("bwd", "flex") if args.bwd else
           ("fwd", "flex"))
    return 0


def open_rows(path: str, dev: str, dt, args, **env):
    """The JSON-lines file, opened with its first line: device, versions, shapes (+ env)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w")
    head = dict(kind="env", torch=torch.__version__,
                device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                B=args.batch, H=args.heads, D=args.head_dim, dtype=str(dt)[6:], **env)
    try:
        import triton
        head["triton"] = triton.__version__
    except ImportError:
        pass
    f.write(json.dumps(head) + "\n")
    print(json.dumps(head), flush=True)
    return f


def forward_rows(f, q, k, v, kw: dict, impls: dict, pairs: float, **fields) -> list:
    """One row per impl of a forward at one mask (fields name it), each written to f and printed
    as it is measured. impls: {name: (what, fn)}, what None for the generic fwd as dispatched (the
    row the others are compared to), a flashtune variant name fn forces (the row names the masked
    twin that ran), or a peer's label. TFLOP/s from the `pairs` the mask keeps."""
    from flashtune.codegen import Variant
    b, h, _, d = q.shape
    rows, base = [], None
    for impl, (what, fn) in impls.items():
        row = dict(fields, impl=impl)
        try:
            with torch.no_grad():
                o = fn(q, k, v)
                if what is None:
                    base = o
                    what = flashtune.explain(q, k, v, **kw).variant.name
                elif _is_variant(what, Variant):
                    with flashtune.force(what):
                        what = flashtune.explain(q, k, v, **kw).variant.name
                row["variant"] = what
                if base is not None:
                    row["maxdiff_vs_fwd"] = float((o.float() - base.float()).abs().max())
                ms = bench_ms(lambda: fn(q, k, v))
        except Exception as e:  # noqa: BLE001 -- a failing impl is a row with why
            row["error"] = repr(e)[:300]
        else:
            row.update(ms=ms, tflops=4.0 * b * h * d * pairs / ms / 1e9)
        rows.append(row)
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(json.dumps(row), flush=True)
    return rows


def _is_variant(text: str, variant_cls) -> bool:
    try:
        variant_cls.parse(text)
    except ValueError:
        return False
    return True


def _bwd_rows(f, q, k, v, n, w, kw, flex, dev, args) -> list:
    """The backward of each impl at one (N, W): hopper_bwd's variants forced, the generic bwd as
    dispatched, Flex (backward_rows)."""
    impls = {"bwd": (None, lambda q, k, v: flashtune.attention(q, k, v, **kw))}
    for name, variant in HOPPER_BWD.items():
        impls[name] = (variant, forced_forward(variant, kw))
    if flex is not None:
        try:
            impls["flex"] = ("flex_attention (compiled)", flex.call(n, w, dev, args.softcap))
        except Exception as e:  # noqa: BLE001
            print(f"flex N={n} W={w}: {e!r}", flush=True)
    return backward_rows(f, q, k, v, kw, impls, window_keys(n, n, True, (w, 0)) * n,
                         kind="window_bwd", N=n, W=w, causal=True, softcap=args.softcap)


def forced_forward(variant: str, kw: dict):
    """flashtune.attention with `variant` forced: a bwd-only family does not serve the forward
    (it is dispatched), and ops carries the forced variant over to the backward."""
    def fwd(q, k, v):
        with flashtune.force(variant):
            return flashtune.attention(q, k, v, **kw)
    return fwd


def backward_rows(f, q, k, v, kw: dict, impls: dict, pairs: float, **fields) -> list:
    """One row per impl of the backward alone at one mask (fields name it): a forward with
    gradients, then torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) timed. impls as
    forward_rows' ({name: (what, forward)}, what None for flashtune as dispatched: the rows'
    base). TFLOP/s = 2.5 x the forward's; maxdiff_vs_bwd is max |dQ, dK, dV - the base's|."""
    from flashtune.codegen import Variant
    b, h, _, d = q.shape
    do = torch.randn_like(q)
    rows, base = [], None
    for impl, (variant, fwd) in impls.items():
        row = dict(fields, impl=impl)
        try:
            xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = fwd(*xs)

            def grad(out=out, xs=xs):
                return torch.autograd.grad(out, xs, do, retain_graph=True)
            got = grad()
            if variant is None:
                base = got
                variant = flashtune.explain(q, k, v, family="bwd", **kw).variant.name
            elif _is_variant(variant, Variant):
                with flashtune.force(variant):
                    variant = flashtune.explain(q, k, v, family="bwd", **kw).variant.name
            row["variant"] = variant
            if base is not None:
                row["maxdiff_vs_bwd"] = max(float((a.float() - c.float()).abs().max())
                                            for a, c in zip(got, base))
            ms = bench_ms(grad)
        except Exception as e:  # noqa: BLE001 -- a failing impl is a row with why
            row["error"] = repr(e)[:300]
        else:
            row.update(ms=ms, tflops=2.5 * 4.0 * b * h * d * pairs / ms / 1e9)
        rows.append(row)
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(json.dumps(row), flush=True)
    return rows


def _table(rows, mine_impls=HOPPER, peers=("fwd", "flex")) -> None:
    print(f"\n{'N':>6} {'W':>5} {'impl':16} {'ms':>8} {'TFLOP/s':>8}  variant")
    for r in rows:
        what = (f"{r['ms']:8.3f} {r['tflops']:8.1f}" if "ms" in r else
                f"error {r.get('error', '')[:60]}")
        print(f"{r['N']:6} {r['W']:5} {r['impl']:16} {what}  {r.get('variant', '')}")
    by = {(r["N"], r["W"], r["impl"]): r["ms"] for r in rows if "ms" in r}
    for n in sorted({r["N"] for r in rows}):
        for mine in mine_impls:
            for peer in peers:
                xs = [by[(n, w, peer)] / by[(n, w, mine)] for (nn, w, i) in by
                      if nn == n and i == mine and (n, w, peer) in by]
                if xs:
                    g = math.exp(sum(map(math.log, xs)) / len(xs))
                    print(f"N={n}: {mine} speed / {peer}: geomean {g:.3f}x over {len(xs)} windows")


if __name__ == "__main__":
    sys.exit(main())
