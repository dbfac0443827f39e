"""Backward benchmark on one GPU: flashtune's backward (both dQ schemes) beside SDPA's flash and
cuDNN backends, measured in the same run, and peak memory of forward+backward beside SDPA's math
backend (which stores the N x N matrices and runs out of memory at long N).

    python3 bench/bwd_bench.py            # standard grid (~3 min on an H100)
    python3 bench/bwd_bench.py --quick    # D=128, N in 1k/4k only (~40 s)

Standard grid (DESIGN.md): bf16, B*N = 16k tokens, hidden 2048 (H=32 at D=64, H=16 at D=128),
N in 512..16k, causal and not. FLOPs: bwd = 2.5 * 4*B*H*N*N*D, halved for causal. The backward
alone is timed: autograd.grad on one saved graph (retain_graph=True), triton.testing.do_bench
median (L2 flushed between runs). Tables go to stdout; JSON to $OUT/bwd_bench.json when $OUT
is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashtune  # noqa: E402
from flashtune.defaults import default_variant  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH}


def _inputs(b, h, n, d, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], do


def _runner(impl: str, causal: bool):
    """impl: 'ft-atomic' | 'ft-separate' | an SDPA backend name -> (context, forward fn)."""
    if impl.startswith("ft-"):
        scheme = impl[3:]

        def fwd(q, k, v):
            return flashtune.attention(q, k, v, causal=causal)
        # force() binds bwd variants only: the forward keeps the dispatcher's fwd variant
        return (lambda d: flashtune.force(default_variant("bwd", d, "bfloat16", dq=scheme))), fwd
    backend = SDPA[impl]

    def fwd(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return (lambda d: sdpa_kernel(backend)), fwd


def bwd_time(impl, b, h, n, d, causal):
    """Median ms of the backward alone, and the gradients (for a cross-check)."""
    ctx, fwd = _runner(impl, causal)
    (q, k, v), do = _inputs(b, h, n, d)
    with ctx(d):
        out = fwd(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        ms = triton.testing.do_bench(
            lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
            warmup=10, rep=60)
    return ms, grads


def tflops(b, h, n, d, causal, ms):
    f = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    return f / (ms * 1e-3) / 1e12


def peak_memory(impl, b, h, n, d, causal):
    """Peak CUDA memory (MiB) of forward+backward above the inputs, or 'OOM'."""
    ctx, fwd = _runner(impl, causal)
    torch.cuda.empty_cache()
    try:
        (q, k, v), do = _inputs(b, h, n, d)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with ctx(d):
            out = fwd(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        del out, grads
        return peak
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    finally:
        torch.cuda.empty_cache()


def _rel_err(a, ref):
    return max(((x.float() - r.float()).abs().max() / r.float().abs().max()).item()
               for x, r in zip(a, ref))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="D=128, N in 1k and 4k, one memory row")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bwd_bench.py needs a CUDA GPU")
    t0 = time.time()
    dims = [128] if args.quick else [64, 128]
    seqlens = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    impls = ["ft-atomic", "ft-separate", "flash", "cudnn"]
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "flashtune": flashtune.__version__,
           "defaults": {d: {s: default_variant("bwd", d, "bfloat16", dq=s).name
                            for s in ("atomic", "separate")} for d in dims}}
    rows = []
    print(f"# backward TFLOP/s, bf16, B*N={TOKENS}, hidden {HIDDEN} -- {env['gpu']}, "
          f"torch {env['torch']}, triton {env['triton']}")
    print("| D | causal | N | " + " | ".join(impls) + " | ft err vs flash |")
    print("|---|---|---|" + "---|" * len(impls) + "---|")
    for d in dims:
        h = HIDDEN // d
        for causal in (False, True):
            for n in seqlens:
                b = TOKENS // n
                cells, ref, errs = [], None, []
                for impl in impls:
                    try:
                        ms, grads = bwd_time(impl, b, h, n, d, causal)
                        tf = tflops(b, h, n, d, causal, ms)
                        rows.append({"kind": "bwd", "impl": impl, "D": d, "H": h, "B": b,
                                     "N": n, "causal": causal, "bwd_ms": ms, "bwd_tflops": tf})
                        cells.append(f"{tf:.0f}")
                        if impl == "flash":
                            ref = grads
                        elif impl.startswith("ft-"):
                            errs.append(grads)
                    except Exception as e:  # noqa: BLE001 -- a failing backend is a table cell
                        rows.append({"kind": "bwd", "impl": impl, "D": d, "H": h, "B": b,
                                     "N": n, "causal": causal, "error": repr(e)[:300]})
                        cells.append("err")
                    torch.cuda.empty_cache()
                err = (f"{max(_rel_err(g, ref) for g in errs):.1e}" if ref is not None and errs
                       else "-")
                print(f"| {d} | {causal} | {n} | " + " | ".join(cells) + f" | {err} |",
                      flush=True)

    # memory: fixed batch and heads, so the math backend's N x N matrices grow quadratically
    mb, mh, md = 2, 16, 128
    mem_seqlens = [4096] if args.quick else [2048, 4096, 8192, 16384]
    mem_impls = ["ft-atomic", "ft-separate", "math"]
    print(f"\n# peak memory of forward+backward above the inputs (MiB), bf16, B={mb}, H={mh}, "
          f"D={md}, non-causal")
    print("| N | " + " | ".join(mem_impls) + " |")
    print("|---|" + "---|" * len(mem_impls))
    for n in mem_seqlens:
        cells = []
        for impl in mem_impls:
            peak = peak_memory(impl, mb, mh, n, md, False)
            rows.append({"kind": "memory", "impl": impl, "D": md, "H": mh, "B": mb, "N": n,
                         "causal": False, "peak_mib": peak})
            cells.append(peak if peak == "OOM" else f"{peak:.0f}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)

    print(f"\n{time.time() - t0:.0f} s")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bwd_bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        print(f"wrote {Path(out) / 'bwd_bench.json'}")


if __name__ == "__main__":
    main()
