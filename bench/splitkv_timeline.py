"""Where a decode step's time goes (issue 9, session 38): the splitkv gluon render's early-start
partial kernel with %globaltimer stamps -- at its entry, its wait's return, its first K tile's
arrival, its loop's end and its exit, and its SM -- for every program of every layer of a
16-layer step replayed as one CUDA graph (L2 flushed before each replay, as the bench), beside
the same step's time without the stamps. The stamps are put into the rendered source here (the
product's kernel is not changed); a summary row per config gives the steady-state layer's parts.

    python3 bench/splitkv_timeline.py --out tl.jsonl [--cells 1/8/1/131072,...]
        [--configs BLOCK_N/STAGES/PRE/TF/PF_MIB,...]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, decode_cell, early_knobs, paged_views, parse_configs  # noqa: E402

SLOTS = 8  # stamps a program: entry, wait, first tile, loop end, exit, SM
CSLOTS = 4  # the combine's: entry, wait, exit, SM
CSTAMP = ("    _c = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)\n"
          "    _t = tl.inline_asm_elementwise(\"mov.u64 $0, %globaltimer;\", \"=l,r\", [_c], "
          "dtype=tl.int64, is_pure=False, pack=1)\n"
          "    tl.store(TS2 + _c * {slots} + {k}, _t)\n")
STAMP = ("    _t = gl.inline_asm_elementwise(\"mov.u64 $0, %globaltimer;\", \"=l,r\", [pid], "
         "dtype=gl.int64, is_pure=False, pack=1)\n"
         "    gl.store(TS + (pid * num_splits + split) * {slots} + {k}, _t)\n")
CSMID = ("    _s = tl.inline_asm_elementwise(\"mov.u32 $0, %smid;\", \"=r,r\", [_c], "
         "dtype=tl.int32, is_pure=False, pack=1)\n"
         "    tl.store(TS2 + _c * {slots} + 3, _s.to(tl.int64))\n")
SMID = ("    _s = gl.inline_asm_elementwise(\"mov.u32 $0, %smid;\", \"=r,r\", [pid], "
        "dtype=gl.int32, is_pure=False, pack=1)\n"
        "    gl.store(TS + (pid * num_splits + split) * {slots} + 5, _s.to(gl.int64))\n")


def _stamp(k: int, indent: str = "") -> str:
    return "".join(indent + ln + "\n" for ln in STAMP.format(slots=SLOTS, k=k).splitlines())


def stamped_source(variant) -> str:
    """The early-start render of `variant` with the stamps (TS: an int64 pointer, the last
    argument before the constexprs)."""
    from flashtune.codegen.render import render
    src = render(dataclasses.replace(variant, early_start=True))
    axis = 0 if variant.structure()["swap_ab"] else 1
    edits = [
        ("                         CNT, steal_own,\n",
         "                         CNT, steal_own, TS,\n"),
        ("    split = gl.program_id(1)\n",
         "    split = gl.program_id(1)\n" + _stamp(0) + SMID.format(slots=SLOTS)),
        ("    gdc_wait()\n    if early_trigger == 1:\n        gdc_launch_dependents()\n",
         "    gdc_wait()\n    if early_trigger == 1:\n        gdc_launch_dependents()\n"
         + _stamp(1)),
        ("    for i in range(n_steps):\n        mbarrier.wait(k_ready.index(st), ph)\n",
         "    for i in range(n_steps):\n        mbarrier.wait(k_ready.index(st), ph)\n"
         "        if i == 0:\n" + _stamp(2, "        ")),
        # STEAL's loop: its first tile is the split's own
        ("        while t_i < n_tiles:\n            mbarrier.wait(k_ready.index(st), ph)\n",
         "        while t_i < n_tiles:\n            mbarrier.wait(k_ready.index(st), ph)\n"
         "            if t_i == split:\n" + _stamp(2, "            ")),
        ("    seen = l_i > 0.0", _stamp(3) + "    seen = l_i > 0.0"),
        # the exit: after O's store (the 16-row tile's, swap_ab, masks its rows on axis 0)
        (f"             mask=gl.expand_dims(ro < GROUP * Nq, {axis}))\n",
         f"             mask=gl.expand_dims(ro < GROUP * Nq, {axis}))\n" + _stamp(4)),
        ("    if USE_PDL:\n        # launched before the partial kernel ends",
         CSTAMP.format(slots=CSLOTS, k=0) + CSMID.format(slots=CSLOTS)
         + "    if USE_PDL:\n        # launched before the partial kernel ends"),
        ("                         stride_ob, stride_om, stride_oh,\n",
         "                         stride_ob, stride_om, stride_oh, TS2,\n"),
        ("    row = tl.program_id(0).to(tl.int64)\n",
         CSTAMP.format(slots=CSLOTS, k=1) + "    row = tl.program_id(0).to(tl.int64)\n"),
        ("             acc.to(O.dtype.element_ty), mask=d_ok)\n",
         "             acc.to(O.dtype.element_ty), mask=d_ok)\n"
         + CSTAMP.format(slots=CSLOTS, k=2)),
    ]
    return edited(src, edits)


def edited(src: str, edits) -> str:
    """src with each (old, new) of `edits` replaced, each old found exactly once (else the
    render changed under the probe: an error, not a silently unedited kernel)."""
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"the render changed: {old.strip()!r} found {src.count(old)}x")
        src = src.replace(old, new)
    return src


def load_source(src: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"flashtune_generated.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # triton reads the source back through inspect/linecache
    spec.loader.exec_module(mod)
    return mod


def summary(ts, cs) -> dict:
    """ts (layers, programs * splits, SLOTS), cs (layers, combine programs, CSLOTS) int64 ns: the
    steady-state layer (layers 3..) in us. A program with no keys has no first-tile stamp (0)."""
    t = ts.double()
    origin = t[0, :, 0].min()
    t = (t - origin) / 1e3
    c = (cs.double() - origin) / 1e3
    rows = []
    for layer in range(t.shape[0]):
        x = t[layer]
        busy = x[:, 2] > 0
        # the SMs the next layer's partial programs ran on
        nxt = set(ts[layer + 1, :, 5].tolist()) if layer + 1 < ts.shape[0] else None
        rows.append({
            "start_min": x[:, 0].min().item(), "start_max": x[:, 0].max().item(),
            "wait_min": x[:, 1].min().item(), "wait_max": x[:, 1].max().item(),
            "first_tile_after_wait": (x[busy, 2] - x[busy, 1]).median().item(),
            "loop_end_med": x[busy, 3].median().item(), "loop_end_max": x[busy, 3].max().item(),
            "exit_max": x[:, 4].max().item(), "exit_med": x[:, 4].median().item(),
            "sms": len(set(ts[layer, :, 5].tolist())),
            "comb_sms": len(set(cs[layer, :, 3].tolist())),
            # the combine's programs on an SM where the next layer's partial runs a program
            "comb_on_next_partial_sms": (
                sum(sm in nxt for sm in cs[layer, :, 3].tolist()) / cs.shape[1]
                if nxt is not None else 0.0),
            "comb_start_min": c[layer, :, 0].min().item(),
            "comb_wait_min": c[layer, :, 1].min().item(),
            "comb_wait_max": c[layer, :, 1].max().item(),
            "comb_exit_max": c[layer, :, 2].max().item()})
    steady = rows[2:]
    per = [(rows[i]["exit_max"] - rows[i - 1]["exit_max"]) for i in range(3, len(rows))]

    def avg(f):
        return statistics.mean(f(i) for i in range(3, len(rows)))
    return {
        "layer_us": statistics.mean(per),
        # the wait returns once the layer before's combine ends
        "last_exit_to_next_wait_us": avg(lambda i: rows[i]["wait_min"] - rows[i - 1]["exit_max"]),
        "start_before_prev_exit_us": avg(lambda i: rows[i - 1]["exit_max"] - rows[i]["start_min"]),
        "wait_to_first_tile_us": statistics.mean(r["first_tile_after_wait"] for r in steady),
        "wait_to_median_loop_end_us": avg(lambda i: rows[i]["loop_end_med"] - rows[i]["wait_min"]),
        "median_to_last_exit_us": avg(lambda i: rows[i]["exit_max"] - rows[i]["loop_end_med"]),
        # partial's last exit -> the combine's first wait return -> its last exit -> the next
        # partial's first wait return
        "exit_to_comb_wait_us": avg(lambda i: rows[i]["comb_wait_min"] - rows[i]["exit_max"]),
        "comb_work_us": avg(lambda i: rows[i]["comb_exit_max"] - rows[i]["comb_wait_min"]),
        "comb_exit_to_next_wait_us": avg(lambda i: rows[i]["wait_min"]
                                         - rows[i - 1]["comb_exit_max"]),
        # the SMs the combine's programs ran on (64 programs at MQA B=1: one each, session 41)
        "comb_sms": statistics.mean(r["comb_sms"] for r in steady),
        "comb_on_next_partial_sms": statistics.mean(r["comb_on_next_partial_sms"]
                                                    for r in steady[:-1]),
        "layers": rows}


def read_flush_ms(replay, reps: int = 40) -> float:
    """Median ms of `replay` (a graph's replay), each after a flush that reads 256 MiB (the L2
    left clean) instead of triton's do_bench, which writes it."""
    buf = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        buf.sum(dtype=torch.int32)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu(out: str, cells, configs, reps: int, page: int = 0) -> None:
    """page: over paged views of the same caches (page-key pages, each sequence's shuffled)."""
    import decode_bench as db
    from flashtune.bench.timing import graphed
    from flashtune.kvcache import fit_pages
    from flashtune.launch_splitkv import SplitKVPlan
    db.GRAPH, db.DEVICE = True, "cuda"
    layers, d = 16, 128
    write = Rows(out)
    raw = open(out + ".raw", "w")  # the rows with every layer's parts and every stamp
    made = [0]
    for cell in cells:
        b, hq, _, nk = (int(x) for x in cell.split("/"))
        q, kcs, vcs, sl, kv_bytes, var = decode_cell(cell, layers, d)
        bt = None
        if page:
            kcs, vcs, bt = paged_views(kcs, vcs, b, nk, page)
        for bn, st, pre, tf, pf, steal, pace, splits, bm in configs:
            gv = fit_pages(dataclasses.replace(var, block_m=bm, block_n=bn, num_warps=4,
                                               num_stages=st, loads="pointer", gluon=True),
                           page or None)
            if splits > 0:  # an explicit split count, started early (as bench/gluon_splitkv.py)
                gv = dataclasses.replace(gv, num_splits=splits, early_start=True)
            label = gv.name
            try:
                plain = SplitKVPlan(q, kcs[0], False, None, gv)
                stamped = SplitKVPlan(q, kcs[0], False, None, gv)
                for p in (plain, stamped):
                    knobs = early_knobs(p, pf, tf, pre, steal, pace=pace)
                label += knobs
                s = plain.num_splits(nk)
                if not plain.early(s):
                    raise RuntimeError("not an early-start launch")
                made[0] += 1
                stamped._mods[True] = load_source(stamped_source(gv), f"timeline_{made[0]}")
                ts = torch.zeros(layers, stamped.programs * s, SLOTS, dtype=torch.int64,
                                 device="cuda")
                from flashtune.launch_splitkv import combine_tile
                chunks = -(-d // combine_tile(s, 128)[1])
                cs = torch.zeros(layers, b * hq * chunks, CSLOTS, dtype=torch.int64,
                                 device="cuda")
                cur = [ts[0], cs[0]]
                gp = stamped._launcher(stamped.partial_key(False, True, nk, s))
                orig = gp.launch
                gp.launch = lambda grid, *a, **k: orig(grid, *a, cur[0], **k)
                ckey = ("combine", s, True, stamped.first_trigger(nk))
                corig = stamped._launcher(ckey)
                stamped._launchers[ckey] = lambda grid, *a, **k: corig(grid, *a, cur[1], **k)
                ref = plain.run(q, kcs[0], vcs[0], sl, bt, nk)[0]
                got = stamped.run(q, kcs[0], vcs[0], sl, bt, nk)[0]
                diff = (got.float() - ref.float()).abs().max().item()

                def step(p, stamp):
                    def run():
                        for i in range(layers):
                            if stamp:
                                cur[0], cur[1] = ts[i], cs[i]
                            p.run(q, kcs[i], vcs[i], sl, bt, nk)
                    return run
                ms = {}
                for name, p, stamp in (("plain", plain, False), ("stamped", stamped, True)):
                    ms[name] = statistics.median(db.bench_ms(step(p, stamp)) / layers
                                                 for _ in range(reps))
                # the plain step after a flush that reads 256 MiB (the timer's own flush writes
                # it: up to the L2's worth of dirty lines are written back during the step)
                ms["read_flush"] = read_flush_ms(graphed(step(plain, False))) / layers
                # one more replay of the stamped graph after an L2 flush: its stamps
                g = graphed(step(stamped, True))
                flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
                flush.zero_()
                g()
                torch.cuda.synchronize()
                row = {"cell": cell, "impl": label, "splits": s, "max_diff": diff,
                       "ms_plain": ms["plain"], "gbps_plain": kv_bytes / ms["plain"] / 1e6,
                       "ms_stamped": ms["stamped"],
                       "gbps_read_flush": kv_bytes / ms["read_flush"] / 1e6,
                       "gbps_stamped": kv_bytes / ms["stamped"] / 1e6,
                       **summary(ts.cpu(), cs.cpu())}
                raw.write(json.dumps({**row, "raw": ts.cpu().tolist(),
                                      "raw_combine": cs.cpu().tolist()}) + "\n")
                raw.flush()
                row.pop("layers")
                write(row)
            except Exception as e:  # noqa: BLE001 -- a config that cannot run is a row
                write({"cell": cell, "impl": label, "error": f"{type(e).__name__}: {e}"[:600]})
        q = kcs = vcs = None
        torch.cuda.empty_cache()
    write.close()
    raw.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="splitkv_timeline.jsonl")
    ap.add_argument("--cells", default="1/8/1/131072,1/8/1/32768")
    ap.add_argument("--configs", default="128/2/1/-1/-1/0,128/2/1/-1/-1/1",
                    help="BLOCK_N/STAGES/PRE/TF/PF_MIB[/STEAL[/PACE[/SPLITS[/BM]]]],... (PRE, TF, "
                    "PF_MIB, STEAL, PACE -1: the launch's own; STEAL 1/0: the splits share the "
                    "tiles past their own or not; PACE: the preload's K / V halves in flight at "
                    "most, 0: all; SPLITS: an explicit count, 0: the rule's; BM: block_m, 64 or "
                    "16 / 32, the rows in wgmma's N (swap_ab); fields after the fifth may follow by name: "
                    "128/2/1/-1/-1:bm=16)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page", type=int, default=0,
                    help="stamp over paged views of the caches, PAGE-key pages in shuffled order "
                    "(0: contiguous)")
    ap.add_argument("--combine", default="",
                    help="TILE/WARPS: the combine kernel's tile (launch_splitkv.COMBINE_TILE) "
                    "and warps for every config (a probe of the combine's share)")
    a = ap.parse_args()
    if a.combine:
        combine_shape(*(int(x) for x in a.combine.split("/")))
    configs = parse_configs(a.configs, ("block_n", "stages", "pre", "tf", "pf_mib", "steal",
                                        "pace", "splits", "bm"), (0,) * 5 + (-1, -1, 0, 64), 5)
    gpu(a.out, a.cells.split(","), configs, a.reps, a.page)


def combine_shape(tile: int, warps: int) -> None:
    """The combine kernel launched with another tile (its programs: rows x D / CHUNK_D) and
    number of warps."""
    from flashtune import launch_splitkv as ls
    ls.COMBINE_TILE = tile
    base = ls.Launcher

    def launcher(kernel, **kw):
        if getattr(kernel, "__name__", "") == "attn_splitkv_combine" or "BLOCK_S" in kw:
            kw["num_warps"] = warps
        return base(kernel, **kw)
    ls.Launcher = launcher


if __name__ == "__main__":
    main()
