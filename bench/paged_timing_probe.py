"""Paged against contiguous decode steps, as the 16 layers' inputs are laid out (issue 9,
session 47). `flashtune bench` put paged MQA B=1 32k within 5% of contiguous (1.03-1.05 in
sessions 40-47) where the probes (gluon_splitkv, decode_bench) read 1.08-1.15 in the same device
calls. This times the same steps -- contiguous, and paged through block tables: the bench's (each
sequence's pages shuffled by a CPU generator seeded 0), the probes' (torch.randperm on the
device), sequential pages, and the bench's as one tensor a layer -- under both timers (the
probes': decode_bench.bench_ms; the bench's: measure_together), over the probes' layout of the
layers' inputs or the bench's (--alloc). On the H100 (session 47, calls 4-8) the timers and the
tables agree; the layout decides: one q and one lengths tensor for every layer (the probes') read
1.06-1.16x contiguous, a q and lengths tensor a layer (the bench's) 1.02-1.06.

    python3 bench/paged_timing_probe.py --out paged_timing.jsonl [--cells 1/8/1/32768,...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, decode_cell, time_steps  # noqa: E402

from flashtune.bench.peers import shuffled_table  # noqa: E402 -- flashtune bench's paged table


def tables(b: int, per: int, device) -> dict:
    """The block tables (b, per) int32 timed: name -> table; every one maps sequence i to its
    own pages i * per .. (i + 1) * per - 1, in three orders."""
    bench = shuffled_table(b, per, device)
    probes = torch.stack([i * per + torch.randperm(per, device=device) for i in range(b)])
    seq = torch.arange(b * per, device=device).view(b, per)
    return {name: t.to(device=device, dtype=torch.int32)
            for name, t in (("bench", bench), ("probes", probes), ("sequential", seq))}


def steps(qs, kcs, vcs, sls, page: int, b: int, nk: int, which=("bench", "probes",
                                                                  "sequential")) -> dict:
    """label -> make(i): layer i's call (its own q, caches and lengths), contiguous and through
    each table of `which` -- one tensor every layer reads, and (" per layer") the bench's table
    as one tensor a layer, as flashtune bench's paged peer builds it."""
    import flashtune
    per = nk // page
    kp = [t.view(b * per, page, *t.shape[2:]) for t in kcs]
    vp = [t.view(b * per, page, *t.shape[2:]) for t in vcs]

    def paged(bts):
        return lambda i: lambda: flashtune.attention_with_kvcache(
            qs[i], kp[i], vp[i], cache_seqlens=sls[i], block_table=bts[i])
    makes = {"contiguous": lambda i: lambda: flashtune.attention_with_kvcache(
        qs[i], kcs[i], vcs[i], cache_seqlens=sls[i])}
    for name, bt in tables(b, per, qs[0].device).items():
        if name in which:
            makes[f"paged{page} {name}"] = paged([bt] * len(kcs))
    makes[f"paged{page} bench per layer"] = paged(
        [shuffled_table(b, per, qs[0].device) for _ in kcs])
    return makes


def layer_inputs(cell: str, layers: int, alloc: str) -> tuple:
    """(qs, kcs, vcs, sls, kv_bytes) of a 16-layer step. alloc "probes": decode_cell's (every
    layer's K, then every layer's V; one q and lengths tensor); "pairs": the same with each
    layer's K and V allocated together; either + "+q" / "+sl" / "+q+sl": a q / lengths tensor
    of its own a layer (copies); "bench": flashtune bench's (make_inputs per layer, seeds 0..:
    its q, K, V and lengths allocated in turn)."""
    base, _, own = alloc.partition("+")  # "+q", "+sl": that tensor one a layer (a copy)
    if base in ("probes", "pairs"):
        q, kcs, vcs, sl, kv_bytes, _ = decode_cell(cell, layers)
        qs = [q.clone() for _ in range(layers)] if "q" in own.split("+") else [q] * layers
        sls = [sl.clone() for _ in range(layers)] if "sl" in own.split("+") else [sl] * layers
        if base == "pairs":  # each layer's K and V allocated together, q and lengths shared
            kcs = vcs = None
            torch.cuda.empty_cache()
            b, hq, hk, nk = (int(x) for x in cell.split("/"))
            pairs = [(torch.randn(b, nk, hk, 128, dtype=torch.bfloat16, device="cuda"),
                      torch.randn(b, nk, hk, 128, dtype=torch.bfloat16, device="cuda"))
                     for _ in range(layers)]
            kcs, vcs = [k for k, _ in pairs], [v for _, v in pairs]
        return qs, kcs, vcs, sls, kv_bytes
    from flashtune.bench.grid import Case
    from flashtune.bench.peers import make_inputs
    b, hq, hk, nk = (int(x) for x in cell.split("/"))
    case = Case("decode", "fwd", b, hq, hk, 1, nk, 128, False)
    inps = [make_inputs(case, "cuda", seed=i) for i in range(layers)]
    qs, kcs, vcs = ([inp.tensors[j] for inp in inps] for j in range(3))
    return qs, kcs, vcs, [inp.extra["cache_seqlens"] for inp in inps], int(case.work())


def bench_timer(write, makes: dict, layers: int, rounds: int, kv_bytes: int, where: dict):
    """flashtune bench's timer: every step in one set of rounds, there and back (measure_together),
    each captured as one CUDA graph of its layers."""
    from flashtune.bench.timing import measure_together, timed_form
    labels = list(makes)
    fns = []
    for label in labels:
        calls = [makes[label](i) for i in range(layers)]
        fns.append(timed_form(lambda calls=calls: [c() for c in calls], "cuda", True)[0])
    for label, got in zip(labels, measure_together(fns, "cuda", rounds=rounds)):
        if isinstance(got, Exception):
            write({**where, "timer": "bench", "impl": label, "error": repr(got)[:300]})
            continue
        ms, spread = got[0] / layers, got[1]
        write({**where, "timer": "bench", "impl": label, "ms": ms, "spread": spread,
               "gbps": kv_bytes / ms / 1e6})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="paged_timing.jsonl")
    ap.add_argument("--cells", default="1/8/1/32768,8/8/1/8192", help="B/Hq/Hk/Nk,...")
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3, help="rounds of the probes' timer")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the bench's timer (0: "
                    "the probes' timer alone)")
    ap.add_argument("--alloc", default="probes", help="probes,pairs,bench: whose allocation of the "
                    "layers' inputs (layer_inputs)")
    ap.add_argument("--tables", default="bench,probes,sequential", help="the shared tables timed")
    a = ap.parse_args()
    import decode_bench as db
    db.GRAPH, db.DEVICE = True, "cuda"
    layers = 16
    write = Rows(a.out)
    for cell, alloc in ((c, al) for c in a.cells.split(",") for al in a.alloc.split(",")):
        b, nk = int(cell.split("/")[0]), int(cell.split("/")[3])
        qs, kcs, vcs, sls, kv_bytes = layer_inputs(cell, layers, alloc)
        makes = steps(qs, kcs, vcs, sls, a.page, b, nk, a.tables.split(","))
        ref = makes["contiguous"](0)()
        where = {"cell": cell, "alloc": alloc}
        for label, make in makes.items():  # every table computes the contiguous step's output
            for i in range(1, layers):  # each layer's lengths seen once outside the capture (a
                make(i)()  # tensor the API has not validated yet is read to the host: a sync)
            diff = (make(0)().float() - ref.float()).abs().max().item()
            write({**where, "impl": label, "max_diff_vs_contiguous": diff})
            if diff > 2e-2:
                raise SystemExit(f"{cell} {label}: differs from contiguous by {diff}")
        time_steps(write, makes, layers, a.reps, kv_bytes, {**where, "timer": "probes"})
        if a.rounds:
            bench_timer(write, makes, layers, a.rounds, kv_bytes, where)
        qs = kcs = vcs = sls = makes = ref = None
        torch.cuda.empty_cache()
    write.close()


if __name__ == "__main__":
    main()
