"""One cell of `flashtune bench --section decode`, timed by the bench's own runner with the
peers named (each alone when run once per peer: a peer that faults takes only its process):

    python3 bench/decode_cell.py --batch 8 --heads 32/8 --nk 2048 --peers flashtune
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashtune.bench import grid, peers, runner  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--nk", type=int, default=2048)
    ap.add_argument("--peers", default="flashtune")
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args(argv)
    h, hk = map(int, a.heads.split("/"))
    case = grid.Case("decode", "fwd", a.batch, h, hk, 1, a.nk, 128, False)
    chosen = [p for p in peers.default_peers() if p.name in a.peers.split(",")]
    inp = peers.make_inputs(case, "cuda")
    more = runner._layers(case, inp, "cuda", a.layers, 20 * 2**30)
    rows = runner.time_cell(case, chosen, inp, "cuda", 60.0, True, more)
    torch.cuda.synchronize()
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("peer", "throughput", "error", "note", "layers")}))


if __name__ == "__main__":
    main()
