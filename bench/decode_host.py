"""A decoding loop as transformers' generate() runs it with a DynamicCache: every step, each layer
appends one token's K/V with torch.cat (a new cache tensor, one key longer, new strides) and calls
attention on it. Eager (no CUDA graph): at batch 8 this is host-bound, so the time per step is
mostly host time. flashtune as it is, and with each of the two host-side fixes of session 28
undone (a plan built and dispatched per step -- no per-bucket plans; Triton's launch path
whenever an int argument changes -- exact ints), beside SDPA (default backend choice, as
transformers' "sdpa" calls it, and cuDNN) on the same loop.

    python3 bench/decode_host.py --out decode_host.json [--batch 8 --steps 128 --layers 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import flashtune  # noqa: E402
from flashtune import launcher, ops  # noqa: E402


class _NoStore(dict):
    def __setitem__(self, key, value):  # the per-bucket plans undone: every step builds one
        pass


def loop(attend, a, q, k0, v0, new_k, new_v, grow: bool = True) -> float:
    """ms per decoding step (all layers), synced at the end of the loop. grow=False: the same
    appends, but attention on the prompt's cache every step (one shape: the steady state)."""
    ks, vs = list(k0), list(v0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for step in range(a.steps):
        for layer in range(a.layers):
            ks[layer] = torch.cat([ks[layer], new_k[layer]], dim=2)
            vs[layer] = torch.cat([vs[layer], new_v[layer]], dim=2)
            if grow:
                attend(q, ks[layer], vs[layer])
            else:
                attend(q, k0[layer], v0[layer])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / a.steps * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", default="16/4")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one flashtune loop")
    a = ap.parse_args(argv)
    hq, hk = (int(x) for x in a.heads.split("/"))
    dev = "cuda"
    mk = lambda n: torch.randn(a.batch, hk, n, a.dim, dtype=torch.bfloat16, device=dev)  # noqa: E731
    q = torch.randn(a.batch, 1, hq, a.dim, dtype=torch.bfloat16, device=dev).transpose(1, 2)
    k0, v0 = [mk(a.prompt) for _ in range(a.layers)], [mk(a.prompt) for _ in range(a.layers)]
    new_k, new_v = [mk(1) for _ in range(a.layers)], [mk(1) for _ in range(a.layers)]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def ft(q, k, v):
        return flashtune.attention(q, k, v)

    def sdpa_default(q, k, v):
        return sdpa(q, k, v, enable_gqa=True)

    def sdpa_cudnn(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, enable_gqa=True)
    real_buckets, real_class = ops._bucket_plans, launcher.int_class

    def undo(buckets: bool, ints: bool):
        ops._plans.clear()
        ops._bucket_plans = _NoStore() if buckets else real_buckets
        ops._bucket_plans.clear()
        launcher.int_class = (lambda x: (type(x), x)) if ints else real_class
    modes = {"flashtune": (ft, (False, False)),
             "flashtune, one cache shape": (ft, (False, False), False),
             "flashtune, a plan per step": (ft, (True, False)),
             "flashtune, exact ints": (ft, (False, True)),
             "flashtune, both undone (session 27)": (ft, (True, True)),
             "sdpa (default choice)": (sdpa_default, None),
             "sdpa (default choice), one cache shape": (sdpa_default, None, False),
             "sdpa cudnn": (sdpa_cudnn, None)}
    times = {m: [] for m in modes}
    for rep in range(a.repeats + 1):  # the first round warms up (compiles), not counted
        for name, (fn, undone, *grow) in modes.items():
            if undone is not None:
                undo(*undone)
            try:
                ms = loop(fn, a, q, k0, v0, new_k, new_v, *grow)
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run is a row
                times[name] = f"{type(e).__name__}: {e}"[:200]
                continue
            if rep and isinstance(times[name], list):
                times[name].append(ms)
    undo(False, False)
    prof_txt = ""
    if a.profile:  # where flashtune's host time goes: one loop under cProfile
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        loop(ft, a, q, k0, v0, new_k, new_v)
        pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(30)
        prof_txt = buf.getvalue()
        print(prof_txt)
    rows = {}
    for name, ts in times.items():
        if isinstance(ts, list) and ts:
            rows[name] = {"ms_per_step": statistics.median(ts), "all": ts}
            print(f"{name:38s} {statistics.median(ts):8.3f} ms per step "
                  f"({a.layers} layers, B={a.batch}, {a.heads}, D={a.dim})", flush=True)
        else:
            rows[name] = {"error": ts}
            print(f"{name:38s} {ts}")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "args": vars(a), "rows": rows,
            "profile": prof_txt}, indent=1))


if __name__ == "__main__":
    main()
