"""Where a search's first compile goes (issue 12): the first trial is told ~2 s after the timing
worker is ready, on one GPU as on four (session 21), whether it compiles in a compile worker or
in the timing worker. Runs what a compile worker runs, in fresh processes: setup("compile"),
then the fwd and hopper_fwd defaults (D=128) compiled twice each; first with empty Triton and
flashtune caches, then again in a new process on the caches the first left (a --warm search's
case), that one under cProfile (the first compile's top functions by cumulative time).

    python3 bench/first_compile_probe.py            # on the GPU machine (needs the driver)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def child(profile: bool) -> None:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    t_torch = time.perf_counter()
    from flashtune import targets
    from flashtune.defaults import default_variant
    from flashtune.measure_gpu import GpuBackend
    from flashtune.search import SearchConfig, plan_of
    h100 = targets.get("H100")
    be = GpuBackend(smem_limit=h100.smem_per_block, capability=90)
    t1 = time.perf_counter()
    be.setup("compile", 0)
    t2 = time.perf_counter()
    print(f"  imports: torch {t_torch - t0:.2f} s, flashtune {t1 - t_torch:.2f} s; "
          f"setup(compile) {t2 - t1:.2f} s", flush=True)
    cfg = SearchConfig(gpu="H100", families=("fwd", "hopper_fwd"), head_dims=(128,),
                       seqlens=(4096,), causal=(False,))
    for i, pb in enumerate(plan_of(cfg, h100)):
        v = default_variant(pb.problem.family, 128, "bfloat16", arch="sm_90")
        for k in range(2):
            prof = None
            if profile and i == 0 and k == 0:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            a = time.perf_counter()
            r = be.compile(v, pb.problem)
            b = time.perf_counter()
            if prof is not None:
                prof.disable()
            print(f"  {v.name}: compile #{k + 1} {b - a:.3f} s "
                  f"{'ok' if r is None else r.reason[:120]}", flush=True)
            if prof is not None:
                import io
                import pstats
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
                print("\n".join(s.getvalue().splitlines()[:40]), flush=True)


def timer_child() -> None:
    """The timing worker's side of the first trial: setup("time"), warm(problem), then the
    first and a second measure of the fwd default (its compile on the caches left above)."""
    import torch
    from flashtune import targets
    from flashtune.defaults import default_variant
    from flashtune.measure_gpu import GpuBackend
    from flashtune.search import SearchConfig, plan_of
    if not torch.cuda.is_available():
        print("  no CUDA: the timing side is not probed")
        return
    h100 = targets.get("H100")
    be = GpuBackend(smem_limit=h100.smem_per_block)
    a = time.perf_counter()
    be.setup("time", 0)
    pb = plan_of(SearchConfig(gpu="H100", families=("fwd",), head_dims=(128,), seqlens=(4096,),
                              causal=(False,)), h100)[0]
    b = time.perf_counter()
    be.warm(pb.problem)
    c = time.perf_counter()
    print(f"  setup(time) {b - a:.2f} s, warm {c - b:.2f} s", flush=True)
    v = default_variant("fwd", 128, "bfloat16")
    for k in range(2):
        a = time.perf_counter()
        r = be.measure(v, pb.problem)
        print(f"  {v.name}: measure #{k + 1} {time.perf_counter() - a:.3f} s "
              f"({r.ms} ms; phases {r.phases})", flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2] == "1")
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--timer":
        timer_child()
        return 0
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, FLASHTUNE_CACHE_DIR=f"{d}/ft", TRITON_CACHE_DIR=f"{d}/triton")
        env.pop("TRITON_INTERPRET", None)
        for label, prof in (("empty caches", "0"), ("the caches the first process left", "1")):
            print(f"process with {label}:", flush=True)
            subprocess.run([sys.executable, __file__, "--child", prof], env=env, timeout=300)
        print("timing worker, on those caches:", flush=True)
        subprocess.run([sys.executable, __file__, "--timer"], env=env, timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
