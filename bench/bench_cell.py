"""One cell of `flashtune bench`, timed the way the bench times it (flashtune/bench/runner.py's
time_cell: the peers together, 16 decode layers, CUDA graphs), to look at one number without
running a whole grid. time_cell replays each peer's graph once and compares every layer with
its eager step (runner._replay_differs): a replay that differs is the row's error.

    python3 bench/bench_cell.py --section decode --batch 64 --heads 32 --kv-heads 8 \\
        --seqlen-k 2048 --peers flashtune,flashtune-paged256 [--eager] [--layers 16]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtune.bench import peers as peer_mod, runner  # noqa: E402
from flashtune.bench.grid import Case  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", default="decode")
    ap.add_argument("--mode", default="fwd")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seqlen-q", type=int, default=1)
    ap.add_argument("--seqlen-k", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peers", default="flashtune,flashtune-paged256")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    a = ap.parse_args(argv)
    case = Case(a.section, a.mode, a.batch, a.heads, a.kv_heads, a.seqlen_q, a.seqlen_k,
                a.head_dim, a.causal)
    ps = peer_mod.by_names(a.peers.split(","))
    inp = peer_mod.make_inputs(case, "cuda")
    more = runner._layers(case, inp, "cuda", a.layers, 20 * 2**30)
    for row in runner.time_cell(case, ps, inp, "cuda", 60.0, not a.eager, more):
        print(json.dumps({k: row.get(k) for k in ("peer", "ms", "throughput", "layers", "timing",
                                                  "max_abs_diff", "error")}), flush=True)


if __name__ == "__main__":
    main()
