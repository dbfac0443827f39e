"""The splitkv family's gluon render (Variant.gluon: the partial kernel in Gluon for sm_90, a TMA
ring and wgmma) beside the variant it would replace, in 16-layer decode steps (issue 9, session
36). Its kernel was first written here, checked on the H100 against float64 (call 16: 10 cases)
and timed (MQA B=1 32k 1,685 vs 1,550 GB/s, 128k 2,447 vs 2,396), then moved into
codegen/templates/attn_splitkv.py.tmpl; tests/test_splitkv_gluon.py tests it there.

    python3 bench/gluon_splitkv.py --out gkv.jsonl [--cells B/Hq/Hk/Nk,...] [--configs 64/2,...]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, decode_cell, early_knobs, paged_views, time_steps  # noqa: E402
from probe_rows import parse_configs as probe_configs  # noqa: E402

from flashtune.launch_splitkv import SplitKVPlan, default_variant  # noqa: E402


def gpu(out: str, cells, configs, reps: int, page: int = 0) -> None:
    """16-layer steps: the dispatched variant beside its gluon twin at each (BLOCK_N, STAGES)
    (the same splits; the early start where the launch takes it), each checked against the
    dispatched output first. page: over a paged view of the same caches (page-key pages, each
    sequence's in shuffled order)."""
    import decode_bench as db

    from flashtune.kvcache import fit_pages
    db.GRAPH, db.DEVICE = True, "cuda"
    layers, d = 16, 128
    write = Rows(out)
    for cell in cells:
        b, nk = int(cell.split("/")[0]), int(cell.split("/")[3])
        q, kcs, vcs, sl, kv_bytes, var = decode_cell(cell, layers, d)
        bt = None
        if page:
            kcs, vcs, bt = paged_views(kcs, vcs, b, nk, page)
            var = fit_pages(var, page)
        plans = {f"{var.name} shipped": SplitKVPlan(q, kcs[0], False, None, var)}
        base = fit_pages(default_variant(d, "bfloat16"), page or None)  # a fixed reference
        if base != var:
            plans[f"{base.name} default"] = SplitKVPlan(q, kcs[0], False, None, base)
        lens = {}  # a plan's lengths argument: the tensor, or None (every sequence nk keys)
        unchecked = set()  # labels timed without their output checked (nc, nw)
        for (bn, st, splits, per_sm, pf_mib, tf, uniform, pre, steal, own, pace, ts, qc, nc,
             bm, nw) in configs:
            gv = fit_pages(dataclasses.replace(var, block_m=bm, block_n=bn, num_warps=4,
                                               num_stages=st, loads="pointer", gluon=True),
                           page or None)
            if splits:  # an explicit split count, started early whatever the wave rule says
                gv = dataclasses.replace(gv, num_splits=splits, early_start=True)
            plan = SplitKVPlan(q, kcs[0], False, None, gv)
            label = gv.name
            if per_sm > 1:  # grids up to per_sm programs an SM count as one wave (early
                plan.sms *= per_sm  # trigger): what a residency-aware rule would say
                label += f" wave{per_sm}"
            label += early_knobs(plan, pf_mib, tf, pre, steal, own, pace, ts)
            if qc:  # the combine on SMs no partial program holds (bench/quiet_combine.py):
                from quiet_combine import install  # QC KiB held; < 0: the shipped grid's chunks
                install(plan, abs(qc), chunked=qc < 0)
                label += f" qc{qc}"
            if nc:  # the partial kernels alone: what the layer costs without its merge
                plan.skip_combine = True
                label += " nocomb"
                unchecked.add(label)
            if nw:  # the early combine without its wait for the partial grid (its reads race
                plan._mods[True] = no_wait_module(gv)  # the partials' stores): the layer if
                label += " nowait"  # the merge had no grid hand-off
                unchecked.add(label)
            if uniform:  # no lengths tensor: the kernels read no length before their first load
                label += " uniform"
                lens[label] = None
            plans[label] = plan
        ref = plans[f"{var.name} shipped"].run(q, kcs[0], vcs[0], sl, bt, nk)[0]
        times = {}
        for label, plan in plans.items():
            try:
                got = plan.run(q, kcs[0], vcs[0], lens.get(label, sl), bt, nk)[0]
                torch.cuda.synchronize()
                diff = (got.float() - ref.float()).abs().max().item()
                write({"cell": cell, "impl": label, "splits": plan.num_splits(nk),
                       "early": plan.early(plan.num_splits(nk)), "max_diff_vs_shipped": diff})
                if diff < 2e-2 or label in unchecked:  # (nocomb, nowait: timed unchecked)
                    times[label] = []
            except Exception as e:  # noqa: BLE001 -- a config that cannot run is a row
                write({"cell": cell, "impl": label, "error": f"{type(e).__name__}: {e}"[:400]})
        time_steps(write, {label: (lambda p, lens_: lambda i: lambda: p.run(
            q, kcs[i], vcs[i], lens_, bt, nk))(plans[label], lens.get(label, sl))
            for label in times}, layers, reps, kv_bytes, {"cell": cell})
        q = kcs = vcs = plans = ref = None
        torch.cuda.empty_cache()
    write.close()


CONFIGS_HELP = (
    "BLOCK_N/STAGES[/SPLITS[/PER_SM[/PF_MIB[/TF[/UNIFORM[/PRE[/STEAL[/OWN[/PACE[/TS[/QC[/NC[/BM]]]]]]]]]]]]],"
    "... "
    "(SPLITS: an explicit count, early start forced, 0: the rule's; "
    "PER_SM: programs an SM holds at once, for the early trigger's one-wave rule; PF_MIB: the "
    "early start's L2 prefetch; TF 1/0: the combine lets the next kernel in before/after its "
    "wait; UNIFORM 1: no lengths tensor; PRE: the ring's tiles the early start loads before its "
    "wait; STEAL 1/0: its splits share the tiles past their own or not; OWN: the tiles a "
    "stealing split owns first; PACE: the preload's K / V halves in flight at most (0: all); "
    "TS 1: the partial kernel lets the combine launch at its programs' start; QC: the combine "
    "as bench/quiet_combine.py's, holding |QC| KiB of shared memory, a program a row or, QC < 0, "
    "the shipped grid's (row, D slice) programs (0: the shipped combine); NC 1: the partial "
    "kernels alone, no combine (timed unchecked); BM: block_m, 64 (the rows in wgmma's M) or "
    "16 / 32 (swap_ab: the rows in its N); -1: the launch's own choice). By name only: NW 1: "
    "the early combine without its wait for the partial grid (timed unchecked: the layer if the "
    "merge had no grid hand-off). Fields may also follow by name after colons, lower-case: "
    "128/2:bm=16:nc=1")


def no_wait_module(variant):
    """The early render of `variant` with its combine's griddepcontrol.wait taken out (a probe:
    the combine then starts once every partial program has let it launch, after their stores,
    and its reads race their landing)."""
    from splitkv_timeline import edited, load_source

    from flashtune.codegen.render import render
    src = edited(render(dataclasses.replace(variant, early_start=True)),
                 [("        tl.extra.cuda.gdc_wait()\n", "        pass\n")])
    return load_source(src, f"gluon_splitkv_nowait_{next(_NO_WAIT_MODULES)}")


_NO_WAIT_MODULES = itertools.count()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gluon_splitkv.jsonl")
    ap.add_argument("--cells", default="1/8/1/32768,1/8/1/131072,1/32/8/32768,8/32/8/8192,"
                    "8/8/1/32768,32/32/8/8192", help="B/Hq/Hk/Nk,... (D=128, one query token)")
    ap.add_argument("--configs", default="64/2", help=CONFIGS_HELP)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page", type=int, default=0,
                    help="time over paged views of the caches, PAGE-key pages in shuffled order "
                    "(0: contiguous)")
    a = ap.parse_args()
    gpu(a.out, a.cells.split(","), parse_configs(a.configs), a.reps, a.page)


# a config's fields in order, and each one's value where a config leaves it out
FIELDS = ("block_n", "stages", "splits", "per_sm", "pf_mib", "tf", "uniform", "pre", "steal",
          "own", "pace", "ts", "qc", "nc", "bm", "nw")
UNSET = (0, 0, 0, 1, -1, -1, 0, -1, -1, 0, -1, -1, 0, 0, 64, 0)


def parse_configs(text: str) -> list:
    """--configs: "BLOCK_N/STAGES[/...]" positional (CONFIGS_HELP's order), then any fields by
    name after colons ("128/2:bm=16:nc=1"), which override the positional ones."""
    return probe_configs(text, FIELDS, UNSET)


if __name__ == "__main__":
    main()
