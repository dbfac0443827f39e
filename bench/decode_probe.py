"""Two decode questions of issue 9, in one device call (bench/decode_bench.py's timing: 16-layer
CUDA graph replays, each layer its own cache, L2 flushed between replays):

  mqa    MQA (8/1) at B=1, 32k and 128k keys: where a step's time goes beside the read ceiling --
         the partial and combine kernels' own durations (torch.profiler, eager, PDL off so the
         combine's wait is not counted as its time) -- and a few partial-kernel shapes that keep
         more bytes in flight per SM (deeper rings, 8 warps, TMA loads, two programs per SM).
  paged  B=1, 2k keys, GQA 32/8 and MQA 8/1: the dispatched variant on the contiguous cache and
         on its 256-key pages (shuffled table, one table for every layer), interleaved over
         --reps repetitions (one cell is ~9 us: single runs differ by 8% for the same kernel),
         then paged variants with fewer, longer splits.

  api    paged against contiguous through the public API, as flashtune bench's paged peer calls
         it, at --batches (1,64): every layer's paged output against the contiguous one (and
         layer 0 against float64), then both timed, interleaved (session 29).

  early  the dispatched variant launched plainly and with early_start (a dependent launch that
         sends its first K/V rows to L2 before it waits for the kernel before it) at prefetch
         budgets (--early), each checked bit for bit against the plain launch first,
         then timed interleaved over --reps repetitions, beside SDPA cuDNN and the read ceiling,
         on --cells (B/Hq/Hk/Nk, comma-separated; default EARLY_CELLS); --early picks the
         launches (EARLY_CONFIGS: prefetch budget, when the combine lets the next layer's partial
         kernel in, the partial kernels alone, no lengths tensor).

    python3 bench/decode_probe.py --out probe.jsonl [--parts mqa,paged,api,early] [--reps 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import decode_bench as db  # noqa: E402
import flashtune  # noqa: E402
from flashtune import kvcache  # noqa: E402
from flashtune.codegen import Variant  # noqa: E402
from flashtune.launch_splitkv import SplitKVPlan  # noqa: E402

D = 128
LAYERS = 16
MQA_VARIANTS = ["splitkv-m64-n64-w4-s3", "splitkv-m64-n64-w4-s3-sp264",
                "splitkv-m64-n64-w4-s5", "splitkv-m64-n128-w8-s3",
                "splitkv-m64-n128-w4-s3-loads=descriptor", "splitkv-m64-n64-w4-s4-loads=descriptor",
                "splitkv-m64-n64-w4-s4-sp264-loads=descriptor", "splitkv-m64-n32-w2-s4-sp264",
                "splitkv-m64-n64-w8-s4"]
PAGED_SPLITS = [8, 16, 32]
EARLY_CELLS = ("1/8/1/2048,1/8/1/8192,1/8/1/32768,1/8/1/131072,1/32/8/2048,1/32/8/32768,"
               "8/32/8/2048,8/32/8/32768,8/8/1/32768,64/32/8/8192")
# early_start's launches beside the plain one (--early): pf<MiB> is the prefetch budget over all
# programs; "tf" lets the next kernel launch before the combine's wait (SplitKVPlan
# .trigger_first); "auto" is the launch's own choice (first_trigger); "+nocomb": the partial
# kernels alone (no combine, so no answer to check: timed only), "+uni": no lengths tensor
# (every sequence full), "+sms<N>": the one-wave rules count N program slots (--variant sp264:
# two programs a SM). Session 35 also timed an evict_last and a bulk prefetch (both slower,
# removed: docs/benchmarks.md).
EARLY_CONFIGS = "pf0,pf2,pf8"


def caches(b, hq, hk, nk, layers):
    q = torch.randn(b, 1, hq, D, dtype=torch.bfloat16, device="cuda")
    kcs = [torch.randn(b, nk, hk, D, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    vcs = [torch.randn_like(k) for k in kcs]
    return q, kcs, vcs


def peers(write, where: dict, q, kcs, vcs, kv_bytes: int, ceiling: bool) -> None:
    """Rows of the same step's plain-read ceiling (where asked) and SDPA cuDNN."""
    if ceiling:
        ceil_ms, progs = db.read_ceiling(kcs, vcs, LAYERS, torch.cuda.get_device_properties(0)
                                         .multi_processor_count)
        write(dict(where, impl="read-ceiling", ms=ceil_ms, gbps=kv_bytes / ceil_ms / 1e6,
                   programs=progs))
    fns = [db.sdpa_peer("cudnn", q, k, v)[0] for k, v in zip(kcs, vcs)]
    ms = db.bench_ms(db.layered(lambda i: fns[i], LAYERS)) / LAYERS
    write(dict(where, impl="sdpa-cudnn", ms=ms, gbps=kv_bytes / ms / 1e6))


def graph_ms(plans, q, kcs, vcs, seqlens, bt, nk) -> float:
    """ms per layer of `plans[i].run` over the layers, as one graph replay."""
    return db.bench_ms(db.layered(
        lambda i: (lambda: plans[i % len(plans)].run(q, kcs[i], vcs[i], seqlens, bt, nk)),
        len(kcs))) / len(kcs)


def kernel_us(plan, q, kc, vc, seqlens, bt, nk) -> dict:
    """Each kernel's mean duration over 20 eager runs, PDL off."""
    plan.pdl = False
    plan.kwargs["USE_PDL"] = False
    plan._launchers.clear()
    for _ in range(3):
        plan.run(q, kc, vc, seqlens, bt, nk)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            plan.run(q, kc, vc, seqlens, bt, nk)
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "splitkv" in e.name:
            per.setdefault(e.name.split("_")[-1], []).append(e.device_time)
    return {k: statistics.mean(v) for k, v in per.items()}


def mqa(write):
    for nk in (32768, 131072):
        q, kcs, vcs = caches(1, 8, 1, nk, LAYERS)
        kv_bytes = 2 * nk * D * 2
        seqlens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        peers(write, {"part": "mqa", "Nk": nk}, q, kcs, vcs, kv_bytes, ceiling=True)
        for name in MQA_VARIANTS:
            try:
                v = Variant.parse(name)
                plan = SplitKVPlan(q, kcs[0], False, None, v)
                ms = graph_ms([plan], q, kcs, vcs, seqlens, None, nk)
                row = {"part": "mqa", "Nk": nk, "impl": name, "ms": ms,
                       "gbps": kv_bytes / ms / 1e6, "splits": plan.num_splits(nk),
                       "kernel_us": kernel_us(SplitKVPlan(q, kcs[0], False, None, v), q, kcs[0],
                                              vcs[0], seqlens, None, nk)}
            except Exception as e:  # noqa: BLE001 -- a shape that cannot run is a row
                row = {"part": "mqa", "Nk": nk, "impl": name,
                       "error": f"{type(e).__name__}: {e}"[:300]}
            write(row)
        del q, kcs, vcs
        torch.cuda.empty_cache()


def paged(write, reps: int):
    page = 256
    for hq, hk in ((32, 8), (8, 1)):
        nk = 2048
        q, kcs, vcs = caches(1, hq, hk, nk, LAYERS)
        kv_bytes = 2 * nk * hk * D * 2
        seqlens = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        pcs = [(k.view(-1, page, hk, D), v.view(-1, page, hk, D)) for k, v in zip(kcs, vcs)]
        bt = torch.randperm(nk // page, device="cuda").to(torch.int32).view(1, -1)
        contiguous = kvcache._variant(q, kcs[0], vcs[0], False, False, nk)
        used = kvcache.fit_pages(contiguous, page)
        runs = {"contiguous " + contiguous.name: (contiguous, False)}
        runs["paged " + used.name] = (used, True)
        for s in PAGED_SPLITS:
            for bn in (16, 32, 64):
                v = dataclasses.replace(used, num_splits=s, block_n=bn)
                runs[f"paged {v.name}"] = (v, True)
        times: dict = {k: [] for k in runs}
        for rep in range(reps):
            for label, (v, is_paged) in runs.items():
                if rep >= 2 and len(times) > 2 and label not in list(runs)[:2]:
                    continue  # the alternatives: two repetitions each
                try:
                    if is_paged:
                        plan = SplitKVPlan(q, pcs[0][0], False, None, v)
                        ms = graph_ms([plan], q, [p[0] for p in pcs], [p[1] for p in pcs],
                                      seqlens, bt, nk)
                    else:
                        plan = SplitKVPlan(q, kcs[0], False, None, v)
                        ms = graph_ms([plan], q, kcs, vcs, seqlens, None, nk)
                    times[label].append(ms)
                except Exception as e:  # noqa: BLE001
                    write({"part": "paged", "Hq": hq, "Hk": hk, "impl": label,
                           "error": f"{type(e).__name__}: {e}"[:300]})
                    times[label] = []
                    break
        base = statistics.median(times["contiguous " + contiguous.name])
        for label, ts in times.items():
            if ts:
                write({"part": "paged", "Hq": hq, "Hk": hk, "Nk": nk, "impl": label,
                       "ms_all": ts, "ms": statistics.median(ts),
                       "gbps": kv_bytes / statistics.median(ts) / 1e6,
                       "vs_contiguous": base / statistics.median(ts)})
        del q, kcs, vcs, pcs
        torch.cuda.empty_cache()


def api(write, reps: int, batches) -> None:
    """Paged against contiguous through attention_with_kvcache, as `flashtune bench`'s
    flashtune-paged256 peer calls it (each sequence's 256-key pages shuffled within its own
    range, one table for every layer), 2k keys, GQA 32/8 and MQA 8/1, at each of `batches`:
    every layer's paged output against the contiguous one, layer 0 against float64 on two
    sequences, then both timed, interleaved over `reps` repetitions."""
    from flashtune.reference import reference
    NK, PAGE = 2048, 256
    for hq, hk in ((32, 8), (8, 1)):
        for b in batches:
            q = torch.randn(b, 1, hq, D, dtype=torch.bfloat16, device="cuda")
            kcs = [torch.randn(b, NK, hk, D, dtype=torch.bfloat16, device="cuda")
                   for _ in range(LAYERS)]
            vcs = [torch.randn_like(k) for k in kcs]
            sl = torch.full((b,), NK, dtype=torch.int32, device="cuda")
            per = NK // PAGE
            gen = torch.Generator().manual_seed(0)
            table = torch.stack([i * per + torch.randperm(per, generator=gen)
                                 for i in range(b)]).to(device="cuda", dtype=torch.int32)

            def contiguous(i):
                return lambda: flashtune.attention_with_kvcache(q, kcs[i], vcs[i],
                                                                cache_seqlens=sl)

            def paged(i):
                return lambda: flashtune.attention_with_kvcache(
                    q, kcs[i].view(-1, PAGE, hk, D), vcs[i].view(-1, PAGE, hk, D),
                    cache_seqlens=sl, block_table=table)
            worst = max(float((contiguous(i)() - paged(i)()).abs().max()) for i in range(LAYERS))
            o = paged(0)()
            ref_err = 0.0
            for s in (0, b - 1):
                ref = reference(q[s:s + 1].transpose(1, 2), kcs[0][s:s + 1].transpose(1, 2),
                                vcs[0][s:s + 1].transpose(1, 2))
                ref_err = max(ref_err, float((o[s:s + 1].transpose(1, 2).double().cpu()
                                              - ref.cpu()).abs().max()))
            times = {"contiguous": [], "paged": []}
            for _ in range(reps):
                for name, make in (("contiguous", contiguous), ("paged", paged)):
                    times[name].append(db.bench_ms(db.layered(make, LAYERS)) / LAYERS)
            kv = 2 * b * NK * hk * D * 2
            ms = {k: statistics.median(v) for k, v in times.items()}
            write({"part": "api", "Hq": hq, "Hk": hk, "B": b, "Nk": NK,
                   "paged_vs_contiguous_max_diff": worst,
                   "paged_vs_fp64_max_err": ref_err,
                   "contiguous_gbps": kv / ms["contiguous"] / 1e6,
                   "paged_gbps": kv / ms["paged"] / 1e6,
                   "paged_over_contiguous": ms["contiguous"] / ms["paged"],
                   "ms_all": times})
            q = kcs = vcs = None  # the caches go before the next shape's (closures hold them)
            torch.cuda.empty_cache()


def early(write, reps: int, cells: str, configs: str = EARLY_CONFIGS,
          variants: str = "") -> None:
    for cell, forced in ((c, f) for c in cells.split(",") for f in (variants.split(",")
                                                                   if variants else [None])):
        # B/Hq/Hk/Nk, or B/Hq/Hk/Nk/pPAGE: the same caches in PAGE-key pages, each sequence's
        # pages shuffled within its own range (one table for every layer), the contiguous
        # record's variant fitted to the pages (as attention_with_kvcache runs it)
        b, hq, hk, nk, *paging = cell.split("/")
        b, hq, hk, nk = int(b), int(hq), int(hk), int(nk)
        page = int(paging[0][1:]) if paging else None
        q, kcs, vcs = caches(b, hq, hk, nk, LAYERS)
        kv_bytes = 2 * b * nk * hk * D * 2
        seqlens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
        where = {"part": "early", "B": b, "Hq": hq, "Hk": hk, "Nk": nk, "page": page}
        variant = kvcache.fit_pages(Variant.parse(forced) if forced else
                                    kvcache._variant(q, kcs[0], vcs[0], False, False, nk), page)
        bt = None
        if page:
            per = nk // page
            bt = torch.stack([i * per + torch.randperm(per, device="cuda") for i in range(b)]
                             ).to(torch.int32)
            kcs = [k.view(-1, page, hk, D) for k in kcs]
            vcs = [v.view(-1, page, hk, D) for v in vcs]
        plans, lengths = {}, {}
        for conf in ["plain"] + configs.split(","):
            base, *mods = conf.split("+")
            plan = SplitKVPlan(q, kcs[0], False, None, variant)
            plan.allow_early = base != "plain"
            m = re.fullmatch(r"pf([\d.]+)(tf)?", base)
            if plan.allow_early and base != "auto":  # auto: the launch's own budget and trigger
                if not m or {x for x in mods if not x.startswith("sms")} - {"nocomb", "uni"}:
                    raise SystemExit(f"--early: {conf!r} is not (plain|auto|pf<MiB>[tf])"
                                     "[+nocomb][+uni][+sms<N>]")
                plan.prefetch_bytes = int(float(m[1]) * (1 << 20))
                plan.trigger_first = bool(m[2])
            plan.skip_combine = "nocomb" in mods
            for x in mods:  # sms<N>: the one-wave rules count N program slots (two a SM: 264)
                if x.startswith("sms"):
                    plan.sms = int(x[3:])
            label = conf if base == "plain" else "early " + conf
            plans[label] = plan
            lengths[label] = None if "uni" in mods else seqlens  # uni: no lengths tensor read
        s = plans["plain"].num_splits(nk)
        ref, ref_lse = plans["plain"].run(q, kcs[0], vcs[0], seqlens, bt, nk)
        times: dict = {}
        for label, plan in plans.items():
            out, lse = plan.run(q, kcs[0], vcs[0], lengths[label], bt, nk)
            torch.cuda.synchronize()
            diff = (out.float() - ref.float()).abs().max().item()
            write(dict(where, impl=f"{variant.name} {label}", splits=s, early=plan.early(s),
                       max_diff=diff, lse_diff=(lse - ref_lse).abs().max().item()))
            if plan.skip_combine or (diff == 0.0 and torch.equal(lse, ref_lse)):
                times[label] = []  # the same answer bit for bit (or a partial kernel alone): timed
        for _ in range(reps):
            for label in times:
                times[label].append(graph_ms([plans[label]], q, kcs, vcs, lengths[label], bt,
                                             nk))
        base_ms = statistics.median(times["plain"])
        for label, ts in times.items():
            ms = statistics.median(ts)
            write(dict(where, impl=f"{variant.name} {label}", ms=ms, ms_all=ts,
                       gbps=kv_bytes / ms / 1e6, vs_base=base_ms / ms, splits=s))
        if not page:
            peers(write, where, q, kcs, vcs, kv_bytes, ceiling=b == 1)
        q = kcs = vcs = plans = ref = bt = None
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="mqa,paged", help="mqa, paged, api (comma-separated)")
    ap.add_argument("--batches", default="1,64", help="api: batch sizes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cells", default=EARLY_CELLS, help="early: B/Hq/Hk/Nk,...")
    ap.add_argument("--early", default=EARLY_CONFIGS,
                    help="early: (plain|auto|pf<MiB>[tf])[+nocomb][+uni][+sms<N>],...")
    ap.add_argument("--variant", default="", help="early: these variants (comma-separated) "
                    "instead of the dispatched one")
    a = ap.parse_args(argv)
    db.GRAPH = True
    out = open(a.out, "w")
    out.write(json.dumps({"kind": "env", "device": torch.cuda.get_device_name(),
                          "torch": torch.__version__,
                          "triton": __import__("triton").__version__}) + "\n")

    def write(row):
        out.write(json.dumps(row) + "\n")
        out.flush()
        keys = ("part", "Hq", "B", "Nk", "page", "impl", "gbps", "vs_contiguous", "vs_base",
                "splits",
                "early", "max_diff", "kernel_us",
                "paged_over_contiguous", "paged_vs_contiguous_max_diff", "error")
        print({k: (round(row[k], 3) if isinstance(row[k], float) else row[k])
               for k in keys if k in row}, flush=True)
    parts = a.parts.split(",")
    if "api" in parts:
        api(write, a.reps, [int(x) for x in a.batches.split(",")])
    if "paged" in parts:
        paged(write, a.reps)
    if "mqa" in parts:
        mqa(write)
    if "early" in parts:
        early(write, a.reps, a.cells, a.early, a.variant)


if __name__ == "__main__":
    main()
