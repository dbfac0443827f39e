"""Turn benchmark JSONL (bench/*.py output) into the markdown tables of docs/benchmarks.md.

    python bench/report.py docs/data/fwd_bench_*.jsonl
"""
from __future__ import annotations

import json
import sys


def _fmt(x):
    return "-" if x is None else f"{x:.0f}"


def table(rows, kind, ours=("flashtune",), peers=("flash", "cudnn")):
    rows = [r for r in rows if r.get("kind") == kind]
    if not rows:
        return ""
    cols = list(ours) + list(peers)
    head = "| D | causal | N | " + " | ".join(cols) + " | vs FA2 | vs cuDNN |"
    out = [head, "|" + "---|" * (len(cols) + 5)]
    for r in rows:
        best = max((r.get(c) or 0) for c in ours)
        rel = lambda p: f"{best / r[p]:.2f}x" if r.get(p) else "-"  # noqa: E731
        out.append(f"| {r['D']} | {r['causal']} | {r['N']} | "
                   + " | ".join(_fmt(r.get(c)) for c in cols) + f" | {rel('flash')} | {rel('cudnn')} |")
    return "\n".join(out)


def main(paths):
    for p in paths:
        rows = [json.loads(line) for line in open(p)]
        env = next((r for r in rows if r.get("kind") == "env"), {})
        print(f"### {p}\n\n{env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, "
              f"CUDA {env.get('cuda')}\n")
        for kind in sorted({r.get("kind") for r in rows} - {"env", "sweep"}):
            ours = sorted({k for r in rows if r.get("kind") == kind for k in r
                           if k.startswith("flashtune")})
            print(f"{kind} (TFLOP/s):\n\n{table(rows, kind, ours=ours)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
