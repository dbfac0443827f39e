"""One cell of `flashtune bench`, timed the way the bench times it (flashtune/bench/runner.py's
time_cell: the peers together, 16 decode layers, CUDA graphs), to look at one number without
running a whole grid:

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
    ap.add_argument("--verify", action="store_true",
                    help="also replay each peer's step as one CUDA graph (prepared in the "
                         "--peers order) and compare every layer's output with the first "
                         "peer's eager one")
    a = ap.parse_args(argv)
    case = Case(a.section, a.mode, a.batch, a.heads, a.kv_heads, a.seqlen_q, a.seqlen_k,
                a.head_dim, a.causal)
    ps = peer_mod.by_names(a.peers.split(","))
    inp = peer_mod.make_inputs(case, "cuda")
    more = runner._layers(case, inp, "cuda", a.layers, 20 * 2**30)
    for row in runner.time_cell(case, ps, inp, "cuda", 60.0, not a.eager, more):
        print(json.dumps({k: row.get(k) for k in ("peer", "ms", "throughput", "layers", "timing",
                                                  "max_abs_diff", "error")}), flush=True)
    if a.verify:
        verify(case, ps, (inp,) + tuple(more))


def verify(case, ps, layers) -> None:
    import torch

    from flashtune import kvcache
    from flashtune.launcher import Launcher
    # what flashtune does on the host while a stream captures: host checks, new plans, launches
    # through Triton's path
    notes = []
    check, plan_cls, call = kvcache._check_values, kvcache.SplitKVPlan, Launcher.__call__

    def spy_check(*a, **kw):
        notes.append(("check", torch.cuda.is_current_stream_capturing()))
        return check(*a, **kw)

    def spy_plan(*a, **kw):
        notes.append(("plan", torch.cuda.is_current_stream_capturing()))
        return plan_cls(*a, **kw)

    def spy_call(self, grid, *args):
        if self.kernel is None or not self._same(args):
            notes.append(("triton launch", torch.cuda.is_current_stream_capturing()))
        return call(self, grid, *args)
    kvcache._check_values, kvcache.SplitKVPlan, Launcher.__call__ = spy_check, spy_plan, spy_call
    steps, eager, keep = [], None, []
    for p in ps:
        with p.context(case):
            fns = [p.prepare(case, m) for m in layers]
            with torch.no_grad():
                got = [f(*m.tensors) for f, m in zip(fns, layers)]
                eager = eager or [g.clone() for g in got]
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    [f(*m.tensors) for f, m in zip(fns, layers)]
                    with torch.cuda.graph(g, stream=s):
                        outs = [f(*m.tensors) for f, m in zip(fns, layers)]
            torch.cuda.synchronize()
            steps.append((p.name, g, outs))
            keep.append(fns)  # the graph reads their block tables: alive until it replays
            print(json.dumps({"peer": p.name, "host events (what, capturing)": notes}), flush=True)
            notes.clear()
    for name, g, outs in steps:
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        diffs = [float((o.float() - e.float()).abs().max()) for o, e in zip(outs, eager)]
        print(json.dumps({"peer": name, "replayed_layers_max_diff": diffs}), flush=True)


if __name__ == "__main__":
    main()
