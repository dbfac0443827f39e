"""Decode benchmark: flashtune.attention_with_kvcache (split-KV), contiguous and paged, beside
SDPA's flash and cuDNN backends on the same data in the same run.

    python bench/decode_bench.py --out decode.jsonl [--batches 1,8,32,64] [--sequential-pages]
        [--seqlens 2048,4096,...,131072] [--heads 32/8,8/1] [--dim 128] [--pages 64,256]
        [--variant splitkv-m64-n64-w4-s3] [--num-splits 0,8,32] [--max-gib 20] [--quick]
        [--defaults] [--no-dense] [--graph] [--layers 16]

"flashtune" rows run as dispatched (the tuned DB or shipped table, else the built-in default;
FLASHTUNE_DB picks the DB), or forced to --variant; --defaults adds "flashtune-defaults" rows
forced to the built-in default, the tuned table's baseline.

One query token per sequence (Nq = 1), every sequence of the batch with Nk cached keys, bf16.
GB/s = (bytes of K and V the problem reads, B * Nk * Hk * D * 2 tensors * 2 bytes) / median time
(triton.testing.do_bench, L2 flushed). --layers L times a decode step of L layers, each with its
own cache (the same shapes, distinct memory, every byte read from DRAM after the flush), and
divides by L: with --graph that is how a server replays a step, and the per-replay cost of
launching the graph (measured ~10 us on the H100, 15% of a 32k-key batch-1 layer) is shared by
the layers as it is in a model, instead of charged to one call. Every implementation is timed
the same way in the same run. The paged cache is the contiguous cache's own memory cut
into pages and addressed through a shuffled block table (same bytes, scattered order: the output
differs from the contiguous one, the traffic does not). A peer that fails (unsupported shape,
out of memory) is written as a row with its error and skipped. Targets (the issue): >= cuDNN
and >= 2,600 GB/s at B=1, Nk >= 32k; paged within 5% of contiguous.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time

import torch
import triton

import flashtune
import flashtune.defaults
from flashtune import kvcache
from flashtune.bench.read_ceiling import fastest, reader, split
from flashtune.launch_splitkv import SplitKVPlan, default_variant


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def layered(make, layers: int):
    """One decode step over `layers` layers: make(i) is layer i's call (its own cache)."""
    calls = [make(i) for i in range(layers)]
    if layers == 1:
        return calls[0]

    def step():
        return [c() for c in calls]
    return step


def _ints(text):
    return [int(x) for x in text.split(",") if x]


DEVICE = "cuda"


def bench_ms(fn) -> float:
    if DEVICE != "cuda":  # --device cpu: a smoke test of this script in the interpreter
        import statistics
        import time
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    if GRAPH:
        # the step as a CUDA graph, as serving runs decoding: replays time the GPU's work, not
        # Python's launch overhead (which bounds every implementation at batch 1, SDPA's too)
        from flashtune.bench.timing import graphed
        return triton.testing.do_bench(graphed(fn), warmup=25, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


GRAPH = False


def sdpa_peer(backend_name, q, kc, vc):
    """SDPA on the same cache: q (B, 1, Hq, D) -> (B, Hq, 1, D); the cache (B, N, Hk, D) viewed
    as (B, Hk, N, D) without a copy. GQA through enable_gqa where the backend takes it, else
    the K/V heads repeated (more bytes read: noted in the row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = qt.shape[1] // kt.shape[1]
    if group == 1:
        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt)
        run()
        return run, "none"
    try:
        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, enable_gqa=True)
        run()
        _sync()
        return run, "enable_gqa"
    except Exception:  # noqa: BLE001 -- try the repeated heads
        kr, vr = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)

        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kr, vr)
        run()
        _sync()
        return run, "repeat_interleave"


def read_ceiling(kcs, vcs, nl: int, sms: int) -> tuple:
    """(ms per layer, programs) of the fastest plain streaming read of the same caches (K and V
    of each layer, one kernel per layer, timed as the decode steps are): what the device reads
    bytes of this size at, launch and ramp included. Best over 1..8 programs per SM."""
    def time_of(programs):
        return bench_ms(layered(lambda i: reader(kcs[i], vcs[i], programs), nl)) / nl
    ms, programs = fastest(sms, time_of)
    return ms, split(kcs[0].numel(), programs)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines file to write")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32, 64])
    ap.add_argument("--seqlens", type=_ints,
                    default=[2048, 4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--heads", default="32/8,8/1", help="Hq/Hk pairs")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pages", type=_ints, default=[64, 256], help="page sizes of the paged runs")
    ap.add_argument("--sequential-pages", action="store_true",
                    help="also time each paged cache with its pages in order (-seq rows): the "
                         "cost of the shuffled table's scattered reads apart from the paging")
    ap.add_argument("--paged-stages", type=_ints, default=[],
                    help="also time each paged cache with the dispatched variant this many "
                         "pipeline stages deeper (+sN rows): more bytes in flight against the "
                         "scattered pages' latency")
    ap.add_argument("--variant", default=None,
                    help="force this splitkv variant (default: as dispatched)")
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the flashtune.attention rows (dense API on the same data)")
    ap.add_argument("--defaults", action="store_true",
                    help="also time the built-in default variant (flashtune-defaults rows)")
    ap.add_argument("--num-splits", type=_ints, default=None,
                    help="also time these num_splits (0 = auto) of the variant, contiguous")
    ap.add_argument("--max-gib", type=float, default=20.0, help="skip caches larger than this")
    ap.add_argument("--quick", action="store_true", help="B in 1,32; Nk in 4k,32k,128k")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each step (the GPU's time, no launch cost)")
    ap.add_argument("--layers", type=int, default=1,
                    help="time a step of this many layers, each with its own cache, per layer "
                         "(fewer where the caches would pass --max-gib)")
    ap.add_argument("--warmup-s", type=float, default=3.0,
                    help="seconds of GPU work before the first shape: a cold GPU clocks higher, "
                         "and the first rows measured were up to 8%% faster than the same "
                         "kernels timed right after them (B=1, GQA, 2k keys: 9.3 vs 10.0 us)")
    ap.add_argument("--read-ceiling", action="store_true",
                    help="also time a plain streaming read of the same K and V (read-ceiling "
                         "rows): the bandwidth bytes of this size are read at, launch included")
    ap.add_argument("--device", default="cuda",
                    help="cpu: smoke-test this script (TRITON_INTERPRET=1, tiny sizes)")
    args = ap.parse_args(argv)
    global DEVICE, GRAPH
    DEVICE = args.device
    GRAPH = args.graph and DEVICE == "cuda"
    if args.quick:
        args.batches, args.seqlens = [1, 32], [4096, 32768, 131072]
    dtype, d = torch.bfloat16, args.dim
    # None: as dispatched (kvcache._variant gives the variant each call runs)
    base = flashtune.codegen.Variant.parse(args.variant) if args.variant else None
    default = default_variant(d)
    props = (torch.cuda.get_device_properties(0) if DEVICE == "cuda"
             else argparse.Namespace(name="cpu", multi_processor_count=0))
    out = open(args.out, "w")

    def write(row):
        out.write(json.dumps(row) + "\n")
        out.flush()

    write({"kind": "env", "graph": GRAPH, "device": props.name, "sm_count": props.multi_processor_count,
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(),
           "variant": base.name if base else "dispatched", "layers": args.layers,
           "db": os.environ.get("FLASHTUNE_DB", "")})
    if DEVICE == "cuda" and args.warmup_s > 0:
        x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEVICE)
        t_end = time.perf_counter() + args.warmup_s
        while time.perf_counter() < t_end:
            for _ in range(10):
                x @ x
            torch.cuda.synchronize()
        del x
    print(f"{'B':>3} {'Hq/Hk':>6} {'Nk':>7} {'impl':<28} {'ms':>9} {'GB/s':>8}")
    for heads in args.heads.split(","):
        hq, hk = (int(x) for x in heads.split("/"))
        for b in args.batches:
            for nk in args.seqlens:
                kv_bytes = 2 * b * nk * hk * d * torch.finfo(dtype).bits // 8
                cfg = dict(B=b, Hq=hq, Hk=hk, Nk=nk, D=d, dtype="bfloat16", kv_bytes=kv_bytes)
                if kv_bytes > args.max_gib * 2**30:
                    write({"kind": "skip", **cfg, "why": f"cache over --max-gib {args.max_gib}"})
                    continue
                nl = max(1, min(args.layers, int(args.max_gib * 2**30 // kv_bytes)))
                cfg["layers"] = nl
                try:
                    q = torch.randn(b, 1, hq, d, dtype=dtype, device=DEVICE)
                    kcs = [torch.randn(b, nk, hk, d, dtype=dtype, device=DEVICE) for _ in range(nl)]
                    vcs = [torch.randn_like(kc) for kc in kcs]
                    kc, vc = kcs[0], vcs[0]
                except torch.OutOfMemoryError as e:
                    write({"kind": "skip", **cfg, "why": f"OOM allocating: {str(e)[:100]}"})
                    _empty_cache()
                    continue
                seqlens = torch.full((b,), nk, dtype=torch.int32, device=DEVICE)
                runs = [("flashtune", base, None)]
                if args.defaults and base is None:
                    runs.append(("flashtune-defaults", default, None))
                for s in args.num_splits or []:
                    runs.append((f"flashtune-sp{s}", default.__class__.from_dict(
                        {**(base or default).to_dict(), "num_splits": s}), None))
                for page in args.pages:
                    if nk % page == 0:
                        runs.append((f"flashtune-paged{page}", base, page))
                        if args.sequential_pages:
                            runs.append((f"flashtune-paged{page}-seq", base, page))
                        for extra in args.paged_stages:  # an int: resolved per cache below
                            runs.append((f"flashtune-paged{page}+s{extra}", extra, page))
                ref = None
                results = {}
                for name, variant, page in runs:
                    try:
                        if page is None:
                            caches, bt = list(zip(kcs, vcs)), None
                        else:
                            caches = [(k_.view(-1, page, hk, d), v_.view(-1, page, hk, d))
                                      for k_, v_ in zip(kcs, vcs)]
                            npages = caches[0][0].shape[0]
                            bt = (torch.arange(npages, device=DEVICE) if name.endswith("-seq")
                                  else torch.randperm(npages, device=DEVICE))
                            bt = bt.to(torch.int32).view(b, nk // page)  # one table, every layer
                        if isinstance(variant, int):  # the dispatched variant, deeper
                            fitted = kvcache._variant(q, *caches[0], True, False, nk)
                            variant = dataclasses.replace(
                                fitted, num_stages=fitted.num_stages + variant)

                        def make(i, bt=bt, variant=variant, caches=caches):
                            kk, vv = caches[i]

                            def fn():
                                with (flashtune.force(variant) if variant is not None
                                      else contextlib.nullcontext()):
                                    return flashtune.attention_with_kvcache(
                                        q, kk, vv, cache_seqlens=seqlens, block_table=bt)
                            return fn
                        o = make(0)()
                        if page is None and ref is None:
                            ref = o
                        ms = bench_ms(layered(make, nl)) / nl
                        # the kernels alone (no validation sync, no variant choice): what the
                        # API's host-side checks cost is ms - ms_kernels
                        kk, vv = caches[0]
                        used = (kvcache.fit_pages(variant, page) if variant is not None else
                                kvcache._variant(q, kk, vv, page is not None, False, nk))
                        plan = SplitKVPlan(q, kk, False, None, used)
                        ms_k = bench_ms(layered(
                            lambda i: (lambda: plan.run(q, *caches[i], seqlens, bt, nk)), nl)) / nl
                        row = {"kind": "result", **cfg, "impl": name, "page": page, "ms": ms,
                               "gbps": kv_bytes / ms / 1e6, "ms_kernels": ms_k,
                               "gbps_kernels": kv_bytes / ms_k / 1e6, "variant": used.name,
                               "num_splits": plan.num_splits(nk), "block_m": plan.block_m}
                    except Exception as e:  # noqa: BLE001 -- a failing run is a row, not a crash
                        row = {"kind": "error", **cfg, "impl": name, "page": page,
                               "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    results[name] = row
                for peer in ("flash", "cudnn"):
                    name = f"sdpa-{peer}"
                    try:
                        fns = [sdpa_peer(peer, q, k_, v_) for k_, v_ in zip(kcs, vcs)]
                        gqa = fns[0][1]
                        o = fns[0][0]().transpose(1, 2)
                        ms = bench_ms(layered(lambda i: fns[i][0], nl)) / nl
                        row = {"kind": "result", **cfg, "impl": name, "ms": ms,
                               "gbps": kv_bytes / ms / 1e6, "gqa": gqa}
                        if ref is not None:
                            row["max_abs_diff_vs_flashtune"] = (o.float() - ref.float()).abs().max().item()
                    except Exception as e:  # noqa: BLE001
                        row = {"kind": "error", **cfg, "impl": name,
                               "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    results[name] = row
                    _empty_cache()
                # flashtune.attention on the same data in SDPA's layout: as dispatched (decode
                # shapes go to split-KV by the dispatcher's heuristic) and forced to the split-Q
                # fwd default, the measurement behind that heuristic
                qt = q.transpose(1, 2)
                kvt = [(k_.transpose(1, 2), v_.transpose(1, 2)) for k_, v_ in zip(kcs, vcs)]
                kt, vt = kvt[0]
                splitq = flashtune.defaults.default_variant("fwd", d, "bfloat16")
                for name, forced in (() if args.no_dense else
                                     (("flashtune-dense", None), ("flashtune-dense-splitq", splitq))):
                    try:
                        def make(i, forced=forced):
                            def fn():
                                if forced is None:
                                    return flashtune.attention(qt, *kvt[i])
                                with flashtune.force(forced):
                                    return flashtune.attention(qt, *kvt[i])
                            return fn
                        make(0)()
                        ms = bench_ms(layered(make, nl)) / nl
                        row = {"kind": "result", **cfg, "impl": name, "ms": ms,
                               "gbps": kv_bytes / ms / 1e6,
                               "variant": (forced or flashtune.explain(qt, kt, vt).variant).name}
                    except Exception as e:  # noqa: BLE001
                        row = {"kind": "error", **cfg, "impl": name,
                               "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    results[name] = row
                if args.read_ceiling and DEVICE == "cuda":
                    try:
                        ms, progs = read_ceiling(kcs, vcs, nl, props.multi_processor_count)
                        results["read-ceiling"] = {"kind": "result", **cfg, "impl": "read-ceiling",
                                                   "ms": ms, "gbps": kv_bytes / ms / 1e6,
                                                   "programs": progs}
                    except Exception as e:  # noqa: BLE001
                        results["read-ceiling"] = {"kind": "error", **cfg, "impl": "read-ceiling",
                                                   "error": f"{type(e).__name__}: {str(e)[:200]}"}
                best_peer = max((r["gbps"] for n, r in results.items()
                                 if n.startswith("sdpa") and "gbps" in r), default=None)
                for name, row in results.items():
                    if best_peer and "gbps" in row:
                        row["vs_best_sdpa"] = row["gbps"] / best_peer
                    if row.get("page") and "gbps" in row and "gbps" in results["flashtune"]:
                        row["vs_contiguous"] = row["gbps"] / results["flashtune"]["gbps"]
                    write(row)
                    shown = (f"{row['ms']:9.4f} {row['gbps']:8.0f}"
                             + (f"  kernels {row['gbps_kernels']:6.0f} GB/s"
                                if "gbps_kernels" in row else "") if "gbps" in row
                             else f"  failed: {row['error'][:60]}")
                    print(f"{b:>3} {heads:>6} {nk:>7} {name:<28} {shown}", flush=True)
                # the cell's tensors go before the next one's (q and kvt set to None, not
                # deleted: the closures above read them)
                del kc, vc, kcs, vcs, kt, vt, ref
                q = kvt = None
                _empty_cache()
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
