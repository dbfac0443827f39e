"""Which objects keep a decode cell's CUDA graphs alive into the next cell (`flashtune bench
--section decode` ran its GQA B=64 128k cell out of memory behind 32 GiB of graph pools,
sessions 29-30): the bench's own runner over a few decode cells; before each cell (after the
runner's collect and empty_cache) the memory in use and every live CUDAGraph with the chain of
objects that refer to it.

    python3 bench/decode_leak.py [--batches 32,64] [--seqlens 32768,131072] [--peers ...]
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from flashtune.bench import grid, peers as peers_mod, runner


def _chain(obj, depth=3, seen=None) -> list[str]:
    """Up to `depth` levels of referrers of obj (types, and function names), frames skipped."""
    seen = seen if seen is not None else {id(obj)}
    out = []
    if depth == 0:
        return out
    for r in gc.get_referrers(obj):
        if id(r) in seen or type(r).__name__ in ("frame", "list_iterator"):
            continue
        if r is globals() or isinstance(r, list) and any(x is seen for x in r):
            continue
        seen.add(id(r))
        name = getattr(r, "__qualname__", "") or getattr(r, "__name__", "")
        out.append("  " * (4 - depth) + f"{type(r).__name__} {name}"[:120])
        out += _chain(r, depth - 1, seen)
    return out


def report(label: str) -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graphs = [o for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)]
    print(f"== {label}: allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved "
          f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB, live CUDAGraphs {len(graphs)}",
          flush=True)
    for g in graphs[:4]:
        print("\n".join(_chain(g)[:40]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--peers", default="")
    a = ap.parse_args()
    shapes = grid.Shapes(decode_batches=tuple(int(x) for x in a.batches.split(",")),
                         decode_seqlens=tuple(int(x) for x in a.seqlens.split(",")),
                         decode_heads=((32, 8),))
    ps = (peers_mod.by_names(a.peers.split(",")) if a.peers else
          [p for p in peers_mod.default_peers() if p.name != "sdpa-math"])
    inner = runner.time_cell
    n = [0]

    def traced(case, *args, **kw):
        report(f"before cell {n[0]} (B={case.batch}, Nk={case.seqlen_k})")
        n[0] += 1
        return inner(case, *args, **kw)
    runner.time_cell = traced
    doc = runner.run(shapes, ("decode",), ps, "cuda", decode_layers=16, progress="lines",
                     stream=sys.stdout)
    report("after the last cell")
    for r in doc["rows"]:
        print(r["batch"], r["seqlen_k"], r["peer"], r.get("throughput") or r.get("error", "")[:100])


if __name__ == "__main__":
    main()
