"""Why a fwd+bwd step can take longer than its forward and backward timed apart (layout_bench,
D=128 N=1k causal: 0.84 ms against 0.70 ms in (B, H, N, D) memory, 1.28 against 0.76 in
(B, N, H, D)): the GPU kernels of a few steps under torch.profiler, per layout, with their
time per step, beside the step's wall time.

    python3 bench/fb_profile.py --out fb_profile.json [--d 128 --n 1024 --b 16 --causal]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

import flashtune  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--b", type=int, default=16)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hk", type=int, default=0, help="kv heads (default: as many as q's)")
    ap.add_argument("--layouts", default="bhnd,bnhd",
                    help="bhnd, bnhd, mixed (q in (B, N, H, D) memory, k and v contiguous)")
    a = ap.parse_args(argv)
    h = 2048 // a.d
    hk = a.hk or h
    report = {}
    for layout in a.layouts.split(","):
        xs = []
        for i, heads in enumerate((h, hk, hk)):
            rows = layout == "bnhd" or (layout == "mixed" and i == 0)
            t = torch.randn((a.b, a.n, heads, a.d) if rows else (a.b, heads, a.n, a.d),
                            dtype=torch.bfloat16, device="cuda")
            xs.append(t.transpose(1, 2) if rows else t)
        xs = [t.requires_grad_() for t in xs]
        out = flashtune.attention(*xs, causal=a.causal)
        do = torch.randn_like(out)

        def step():
            return torch.autograd.grad(flashtune.attention(*xs, causal=a.causal), xs, do)

        def bwd():
            return torch.autograd.grad(out, xs, do, retain_graph=True)
        ms = {"fwd+bwd": triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median"),
              "bwd": triton.testing.do_bench(bwd, warmup=10, rep=60, return_mode="median")}
        with torch.no_grad():
            ms["fwd"] = triton.testing.do_bench(lambda: flashtune.attention(*xs, causal=a.causal),
                                                warmup=10, rep=60, return_mode="median")
        rows = {}
        for name, fn in (("fwd+bwd", step), ("bwd", bwd)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    fn()
                torch.cuda.synchronize()
            per = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name[:90]] += e.device_time / a.steps / 1000  # ms per step
            rows[name] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
        # host time per call: launches queue ahead unless the host is the bottleneck
        import cProfile
        import io
        import pstats
        import time
        host = {}
        for name, fn in (("fwd+bwd", step), ("bwd", bwd)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(30):
                fn()
            host[name] = (time.perf_counter() - t) / 30 * 1e3
            torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            bwd()
        torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        prof_txt = buf.getvalue()
        print("  host ms per call (no sync): " + ", ".join(f"{k} {v:.3f}" for k, v in host.items()))
        print("\n".join(prof_txt.splitlines()[:34]))
        report[layout] = {"ms": ms, "kernels_ms_per_step": rows, "host_ms": host,
                          "bwd_cprofile": prof_txt}
        print(f"== {layout}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
        for name, per in rows.items():
            print(f"  {name}: kernels {sum(per.values()):.3f} ms per step")
            for k, v in list(per.items())[:8]:
                print(f"    {v:8.3f}  {k}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
