"""Host time of a masked flashtune.attention forward + backward against the dense call (issue 11):
the Python path (validation, dispatch, launch plans, autograd) per call, per mask case.

    python3 bench/mask_host_overhead.py                          # GPU: tiny shape, host-bound
    TRITON_INTERPRET=1 python3 bench/mask_host_overhead.py --stub  # CPU: kernel launches stubbed

Method: back-to-back calls on a problem small enough (N=512, B=1, H=1, D=64) that the GPU
finishes each kernel long before the host issues the next, so the loop measures host time
(the GPU time of the same loop is printed beside it: it must stay below). --stub replaces every
Triton / Gluon launch by a no-op (no interpreter runs), so the CPU measures flashtune's own
Python path; the launches themselves are then free. Rows per case: `fwd` (no grad),
`fwd(grad)` (the autograd forward) and `fwd+bwd` (torch.autograd.grad), microseconds per call,
the minimum over interleaved repetitions. On the GPU each case also runs once under
torch.cuda.set_sync_debug_mode("warn"): `syncs` counts the device->host synchronisations a
repeated call performs (must be 0). JSON lines to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def stub_launches() -> list:
    """Make every Triton / Gluon kernel launch a no-op that records the kernel's name."""
    launched: list = []

    def getitem(self, grid):
        def run(*args, **kwargs):
            launched.append(getattr(self, "__name__", "?"))
        return run
    from triton.runtime import jit
    jit.JITFunction.__getitem__ = getitem
    try:
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.__getitem__ = getitem
    except ImportError:
        pass
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
        GluonJITFunction.__getitem__ = getitem
    except ImportError:
        pass
    return launched


def cases(n: int, device: str) -> dict:
    import flashtune
    nb = n // 128
    g = torch.Generator().manual_seed(0)
    sparse = torch.rand(1, 1, nb, nb, generator=g) < 0.3
    sparse |= torch.eye(nb, dtype=torch.bool)  # no empty row
    elem = torch.rand(n, n, generator=g) < 0.5
    full = torch.ones(1, 1, nb, nb, dtype=torch.bool)
    bm = flashtune.BlockMask.from_dense
    return {
        "dense": {},
        "causal": dict(causal=True),
        "window": dict(causal=True, window=(256, 0)),
        "softcap": dict(softcap=30.0),
        "window+softcap": dict(window=(128, 128), softcap=30.0),
        "block100": dict(block_mask=bm(full.to(device), (n, n))),
        "block30": dict(block_mask=bm(sparse.to(device), (n, n))),
        "block30+elem": dict(block_mask=bm(sparse.to(device), (n, n), mask=elem.to(device))),
        "block30+causal+softcap": dict(causal=True, softcap=30.0,
                                       block_mask=bm(sparse.to(device), (n, n))),
    }


def host_us(fn, iters: int, reps: int, cuda: bool) -> tuple:
    """(host us per call, GPU us per call or None), minimum host time over `reps` loops."""
    best, gpu = float("inf"), None
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t) / iters * 1e6
        if cuda:
            end.record()
            torch.cuda.synchronize()
            gpu = start.elapsed_time(end) / iters * 1e3
        best = min(best, host)
    return best, gpu


def count_calls(fn) -> tuple:
    """(Python calls, C calls) one call of fn makes: a noise-free measure of host work (a
    shared CPU's timings wander by 2x)."""
    n = [0, 0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1
        elif event == "c_call":
            n[1] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return tuple(n)


def count_syncs(fn) -> int:
    """Device->host synchronisations of one call (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--stub", action="store_true", help="stub every kernel launch (CPU)")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    launched = stub_launches() if args.stub else []
    import flashtune
    cuda = torch.cuda.is_available() and not args.stub
    device = "cuda" if cuda else "cpu"
    n, d = args.n, args.head_dim
    dt = torch.bfloat16 if cuda else torch.float16
    q, k, v = (torch.randn(1, 1, n, d, dtype=dt, device=device, requires_grad=True)
               for _ in range(3))
    g = torch.randn(1, 1, n, d, dtype=dt, device=device)
    out = open(args.out, "w") if args.out else None
    only = set(filter(None, args.only.split(",")))
    print(f"{'case':24s} {'fwd':>8s} {'fwd(grad)':>10s} {'fwd+bwd':>9s} {'py/C calls':>11s}  "
          f"(host us per call{', GPU us of fwd+bwd' if cuda else ''})")
    for name, kw in cases(n, device).items():
        if only and name not in only:
            continue

        def fwd(kw=kw):
            with torch.no_grad():
                flashtune.attention(q, k, v, **kw)

        def fwd_grad(kw=kw):
            flashtune.attention(q, k, v, **kw)

        def step(kw=kw):
            torch.autograd.grad(flashtune.attention(q, k, v, **kw), (q, k, v), g)
        row = {"case": name, "N": n, "D": d, "device": torch.cuda.get_device_name() if cuda
               else "cpu (launches stubbed)" if args.stub else "cpu"}
        try:
            for f in (fwd, fwd_grad, step):  # warm: kernels compiled, plans built
                for _ in range(3):
                    f()
            launched.clear()
            step()
            row["launches"] = list(launched)
            for label, f in (("fwd", fwd), ("fwd_grad", fwd_grad), ("fwd_bwd", step)):
                row[f"{label}_us"], gpu = host_us(f, args.iters, args.reps, cuda)
                if gpu is not None:
                    row[f"{label}_gpu_us"] = gpu
            row["fwd_bwd_py_calls"], row["fwd_bwd_c_calls"] = count_calls(step)
            if cuda:
                row["syncs"] = count_syncs(step)
        except Exception as e:  # noqa: BLE001 -- a failing case is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "error" in row:
            print(f"{name:24s} failed: {row['error']}")
        else:
            extra = (f"   gpu {row['fwd_bwd_gpu_us']:.1f}, syncs {row['syncs']}" if cuda else "")
            calls = f"{row['fwd_bwd_py_calls']}/{row['fwd_bwd_c_calls']}"
            print(f"{name:24s} {row['fwd_us']:8.1f} {row['fwd_grad_us']:10.1f} "
                  f"{row['fwd_bwd_us']:9.1f} {calls:>11s}{extra}")
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
