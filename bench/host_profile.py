"""Where the host time of a forward + backward goes (issue 11): on the H100 a host-bound
fwd+bwd (N=512, B=1, H=1, D=64) took ~660 us of host time per call against ~60 us for the
forward with gradients, while the same Python path with every launch stubbed out takes
100-121 us on the CPU. This times the pieces separately and profiles them:

    python3 bench/host_profile.py --out host_profile.json        # GPU
    python3 bench/host_profile.py --case block30

Per case, with Triton's launch path (FLASHTUNE_SLOW_LAUNCH=1) and with launcher.Launcher's
direct launches: host us per call of the forward (no grad), the backward called directly
(ops.run_backward on this thread), its plan's run() alone and the autograd fwd+bwd
(torch.autograd.grad); cProfile of the direct backward and of the autograd step (the 25
functions with the most own time; printed with --print-profiles). Beside them: a bare Triton
launch of a trivial kernel with 8 and 48 arguments, torch.autograd.grad through a Function
that launches nothing (the engine's own cost), and compiled Flex's forward and fwd+bwd on the
same inputs. JSON to --out.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def per_call_us(fn, iters: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters * 1e6)
    torch.cuda.synchronize()
    return best


def top(fn, iters: int, n: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(n)
    st.sort_stats("cumulative").print_stats(n)
    return s.getvalue()


def bare_launch(n_args: int):
    """A trivial Triton kernel taking n_args int arguments and one pointer: the launch path's
    own cost on this host."""
    names = [f"a{i}" for i in range(n_args)]
    # triton.jit reads its function's source: the kernel goes through a file
    path = Path(f"/tmp/flashtune_bare_kernel_{n_args}.py")
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    f"def bare(X, {', '.join(names)}, C: tl.constexpr):\n"
                    f"    tl.store(X + tl.program_id(0), {' + '.join(names[:4])})\n")
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kern = mod.bare
    x = torch.zeros(4, dtype=torch.int32, device="cuda")
    vals = [7 + 16 * i for i in range(n_args)]
    return lambda: kern[(1,)](x, *vals, C=1)


class Ident(torch.autograd.Function):
    """A Function that launches nothing (bench/host_bwd.py too): the autograd engine's cost."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def engine_us(iters: int, reps: int) -> float:
    """torch.autograd.grad through a Function that launches nothing: the engine's own cost."""
    x = torch.randn(16, device="cuda", requires_grad=True)
    g = torch.randn(16, device="cuda")
    return per_call_us(lambda: torch.autograd.grad(Ident.apply(x), (x,), g), iters, reps)


def flex_us(q, k, v, g, iters: int, reps: int) -> dict:
    """Compiled FlexAttention's forward and autograd fwd+bwd on the same inputs, no mask: the
    same engine hand-off with Inductor's launchers (is the rest of a step's host time torch's
    or flashtune's?). {} when Flex cannot run here."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention)

        def fwd():
            with torch.no_grad():
                flex(q, k, v)

        def step():
            torch.autograd.grad(flex(q, k, v), (q, k, v), g)
        for _ in range(3):
            step()
        return {"fwd_us": per_call_us(fwd, iters, reps),
                "fwd_bwd_autograd_us": per_call_us(step, iters, reps)}
    except Exception as e:  # noqa: BLE001 -- a peer that cannot run is a line
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def one_case(name, q, k, v, g, kw, masks, args) -> dict:
    import flashtune
    from flashtune import ops

    def fwd():
        with torch.no_grad():
            flashtune.attention(q, k, v, **kw)

    def step():
        torch.autograd.grad(flashtune.attention(q, k, v, **kw), (q, k, v), g)
    for _ in range(3):
        step()
    with torch.no_grad():
        o, lse = ops.run_forward(q, k, v, False, None, masks=masks)

    def bwd():
        ops.run_backward(g, q, k, v, o, lse, False, None, masks=masks)
    bwd()
    plan = list(ops._bwd_plans.values())[-1]

    def plan_run():
        plan.run(g, q, k, v, o, lse)
    row = {}
    for label, f in (("fwd", fwd), ("bwd_direct", bwd), ("bwd_plan_run", plan_run),
                     ("fwd_bwd_autograd", step)):
        row[f"{label}_us"] = per_call_us(f, args.iters, args.reps)
    row["plan"] = type(plan).__name__ + " " + getattr(getattr(plan, "variant", None), "name", "?")
    print(f"{name}: " + ", ".join(f"{k_} {v_:.1f} us" for k_, v_ in row.items()
                                  if k_.endswith("_us")) + f"  ({row['plan']})")
    row["profile_bwd_direct"] = top(bwd, args.iters)
    row["profile_fwd_bwd_autograd"] = top(step, args.iters)
    if args.print_profiles:
        print(f"--- {name}: cProfile, backward called directly ({args.iters} calls)")
        print(row["profile_bwd_direct"][:6000])
        print(f"--- {name}: cProfile, autograd fwd+bwd ({args.iters} calls)")
        print(row["profile_fwd_bwd_autograd"][:6000])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--case", default="dense,block30")
    ap.add_argument("--out", default=None)
    ap.add_argument("--print-profiles", action="store_true", help="print the cProfile tables")
    args = ap.parse_args(argv)
    from flashtune import ops
    from flashtune.masks import NONE
    from mask_host_overhead import cases
    n, d = args.n, args.head_dim
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))
    g = torch.randn(1, 1, n, d, dtype=torch.bfloat16, device="cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "N": n, "D": d, "cases": {}}
    import triton
    report["triton"] = triton.__version__
    for n_args in (8, 48):
        f = bare_launch(n_args)
        f()
        report[f"bare_launch_{n_args}_args_us"] = per_call_us(f, args.iters, args.reps)
        print(f"bare Triton launch, {n_args} int args: "
              f"{report[f'bare_launch_{n_args}_args_us']:.1f} us")
    report["autograd_engine_us"] = engine_us(args.iters, args.reps)
    print(f"autograd engine alone (identity Function, torch.autograd.grad): "
          f"{report['autograd_engine_us']:.1f} us")
    report["flex"] = flex_us(q, k, v, g, args.iters, args.reps)
    print(f"Flex (compiled, no mask): {report['flex']}")
    all_cases = cases(n, "cuda")
    for name in args.case.split(","):
        kw = all_cases[name]
        masks = NONE
        if kw.get("block_mask") is not None:
            from flashtune.masks import Masks
            masks = Masks(None, None, kw["block_mask"])
        for launch in ("triton", "direct"):
            # launcher.Launcher reads FLASHTUNE_SLOW_LAUNCH when a plan is built: fresh plans
            os.environ["FLASHTUNE_SLOW_LAUNCH"] = "1" if launch == "triton" else "0"
            ops._plans.clear()
            ops._bwd_plans.clear()
            label = f"{name}, {launch} launches"
            report["cases"][label] = one_case(label, q, k, v, g, kw, masks, args)
        os.environ.pop("FLASHTUNE_SLOW_LAUNCH", None)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
