"""flashtune and SDPA's backends on q, k, v in (B, H, N, D) memory and in (B, N, H, D) memory
(a transformers model's projections viewed as (B, H, N, D)), same shapes, one run; `ft-before`:
flashtune with its Hopper plans refusing the (B, N, H*D) view, as before the bnhd renders.

    python3 bench/layout_bench.py --out layout.jsonl     # D 64/128, N 1k/4k, 16k tokens, bf16

Rows per (D, N, causal, layout, impl): fwd, bwd (autograd.grad on one saved graph, dO laid out
like O: a model's gradient arrives through the same transpose) and fwd+bwd, in TFLOP/s
(DESIGN.md: 4*B*H*N^2*D per forward, halved for causal; bwd 2.5x; fwd+bwd 3.5x). Times:
triton.testing.do_bench medians (L2 flushed between runs). `plans` names the flashtune plans that
ran each cell (HopperFwdPlan[bnhd]: hopper_fwd's bnhd render; HopperBwdPlan[rows]: hopper_bwd's
varlen render on equal lengths; FwdPlan / BwdPlan: the generic families).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashtune  # noqa: E402
from flashtune import dispatch  # noqa: E402
from flashtune.bench.runner import environment  # noqa: E402
from varlen_bench import time_passes  # noqa: E402

FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
SDPA = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}


def impls():
    def ft(q, k, v, causal):
        return flashtune.attention(q, k, v, causal=causal)

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    return {"flashtune": ft, "ft-before": ft, **{name: sdpa(b) for name, b in SDPA.items()}}


@contextlib.contextmanager
def before_bnhd(on: bool):
    """flashtune as it was before session 27 (`ft-before`): the Hopper plans take no view of
    (B, N, H, D) memory, so such calls run the generic families. Plans are built and cached
    under the patch: the caller clears the cache around it."""
    from flashtune import launch_hopper, launch_hopper_bwd
    mods = (launch_hopper, launch_hopper_bwd)
    real = [m._rows_view for m in mods]
    if on:
        for m in mods:
            m._rows_view = lambda t: None
    try:
        yield
    finally:
        for m, r in zip(mods, real):
            m._rows_view = r


def timed(fn, q, k, v, causal):
    """{pass: median ms}, dO in the output's layout (varlen_bench.time_passes)."""
    gen = torch.Generator(device=q.device).manual_seed(0)
    return time_passes(lambda *xs: fn(*xs, causal), (q, k, v), gen, do_like_out=True)


def _plan_name(plan) -> str:
    name = type(plan).__name__
    if getattr(getattr(plan, "variant", None), "bnhd", False):
        name += "[bnhd]"
    if name == "HopperBwdPlan" and plan.rows is not None:  # (the generic BwdPlan has .rows too)
        name += "[rows]"
    return name + ("(fallback)" if getattr(plan, "why", "") else "")


def plans_of(fn, q, k, v, causal) -> list:
    """The flashtune plan classes (and bnhd) one fwd+bwd ran."""
    from flashtune import launch, launch_bwd, launch_hopper, launch_hopper_bwd
    seen, saved = [], []
    for cls in (launch_hopper.HopperFwdPlan, launch_hopper_bwd.HopperBwdPlan, launch.FwdPlan,
                launch_bwd.BwdPlan):
        real = cls.run
        saved.append((cls, real))
        cls.run = (lambda self, *a, real=real: seen.append(_plan_name(self)) or real(self, *a))
    try:
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*xs, causal)
        torch.autograd.grad(out, xs, torch.randn_like(out))
    finally:
        for cls, real in saved:
            cls.run = real
    return seen


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args(argv)
    out = open(a.out, "w") if a.out else None

    def emit(row):
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    emit({"kind": "env", **environment("cuda")})
    print(f"{'D':>3} {'N':>5} {'causal':<6} {'layout':<5} {'impl':<11} "
          f"{'fwd':>7} {'bwd':>7} {'f+b':>7}  plans (TFLOP/s)")
    for d in map(int, a.head_dims.split(",")):
        h = 2048 // d
        for n in map(int, a.seqlens.split(",")):
            b = max(1, a.tokens // n)
            for causal in (False, True):
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                for layout in ("bhnd", "bnhd"):
                    shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
                    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda")
                               for _ in range(3))
                    if layout == "bnhd":
                        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                    for name, fn in impls().items():
                        if name == "ft-before" and layout == "bhnd":
                            continue  # the same kernels as flashtune
                        dispatch.clear_cache()  # no plan shared with ft-before
                        try:
                            with before_bnhd(name == "ft-before"):
                                ms = timed(fn, q, k, v, causal)
                                plans = (plans_of(fn, q, k, v, causal)
                                         if name.startswith("f") else [])
                        except RuntimeError as e:  # a backend that refuses the layout
                            print(f"{d:>3} {n:>5} {causal!s:<6} {layout:<5} {name:<11} "
                                  f"failed: {str(e).splitlines()[0][:80]}")
                            continue
                        tf = {p: flops * FACTOR[p] / (m * 1e-3) / 1e12 for p, m in ms.items()}
                        emit({"kind": "result", "D": d, "N": n, "B": b, "H": h,
                              "causal": causal, "layout": layout, "impl": name, "ms": ms,
                              "tflops": tf, "plans": plans})
                        print(f"{d:>3} {n:>5} {causal!s:<6} {layout:<5} {name:<11} "
                              f"{tf['fwd']:7.1f} {tf['bwd']:7.1f} {tf['fwd+bwd']:7.1f}  "
                              f"{' '.join(plans)}")
    if out:
        out.close()


if __name__ == "__main__":
    main()
