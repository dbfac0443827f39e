"""Where a multi-GPU search's start-up goes: each of N processes (one per GPU, pinned with
CUDA_VISIBLE_DEVICES, forked from one parent that imported torch, as the search's timing
workers are) times its CUDA start: cuInit, the first allocation (context), Triton's driver
utilities, a float64 reference and a bf16 SDPA call. Modes:

    one        GPU 0 alone
    all        every GPU at once
    all+load   every GPU at once, beside --load busy processes at nice 10 (the compile workers
               that start beside the timing workers)
    staggered  every GPU, each started when the previous one has its context

    python3 bench/cuda_init_probe.py --gpus 4 --load 56 --out $OUT/cuda_init.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def _child(dev: int, t_go: float, q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(dev)
    import torch

    while time.time() < t_go:
        time.sleep(0.001)
    marks = {"start": time.time()}
    torch.cuda.init()
    marks["cuinit"] = time.time()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    marks["context"] = time.time()
    from triton.runtime import driver

    driver.active.get_current_target()
    marks["triton"] = time.time()
    q_, k_ = (torch.randn(8, 16, 512, 128, device="cuda", dtype=torch.float64) for _ in range(2))
    (torch.softmax(q_ @ k_.transpose(-1, -2), -1) @ k_).sum().item()
    marks["float64"] = time.time()
    x = torch.randn(8, 16, 512, 128, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(x, x, x).sum().item()
    marks["sdpa"] = time.time()
    q.put((dev, marks))


def _burn(stop_at: float) -> None:
    os.nice(10)
    x = 0
    while time.time() < stop_at:
        x += 1


def run(mode: str, n: int, load: int) -> dict:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    q = ctx.Queue()
    devs = [0] if mode == "one" else list(range(n))
    t_go = time.time() + 3.0  # every child forked and importing done before the clock starts
    burners = [ctx.Process(target=_burn, args=(t_go + 12,)) for _ in range(load if mode == "all+load" else 0)]
    procs = []
    res = {}
    if mode == "staggered":
        for d in devs:
            p = ctx.Process(target=_child, args=(d, time.time() + 2.0, q))
            p.start()
            dev, m = q.get(timeout=120)
            res[dev] = m
            p.join()
    else:
        for d in devs:
            p = ctx.Process(target=_child, args=(d, t_go, q))
            p.start()
            procs.append(p)
        for b in burners:
            b.start()
        for _ in devs:
            dev, m = q.get(timeout=120)
            res[dev] = m
        for p in procs + burners:
            p.join(20)
    out = {}
    for dev, m in sorted(res.items()):
        keys = list(m)
        out[dev] = {k: round(m[k] - m[keys[i - 1]], 3) for i, k in enumerate(keys) if i}
        out[dev]["total"] = round(m["sdpa"] - m["start"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--load", type=int, default=56)
    ap.add_argument("--modes", default="one,all,all+load,staggered")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    doc = {}
    for mode in a.modes.split(","):
        doc[mode] = run(mode, a.gpus, a.load)
        for dev, ph in doc[mode].items():
            print(f"{mode:10s} gpu{dev}: " + "  ".join(f"{k} {v:.3f}" for k, v in ph.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
