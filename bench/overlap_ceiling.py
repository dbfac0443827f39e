"""How fast a 16-layer decode step could read its K and V if each layer's reads overlapped the
layer before (issue 9, session 36): the read ceiling (flashtune/bench/read_ceiling.py: one plain
kernel a layer, each after the last) beside the same read launched as a programmatic dependent
(PDL) in three orders:

    wait    waits for the kernel before, lets the next launch, reads: launch overlap only
    l2      lets the next launch, sends its bytes to L2 (prefetch), waits, reads them: the
            order an attention kernel can keep (its K/V may be fetched before its wait, but
            its query, the layer before's output, only after)
    early   lets the next launch, reads everything, then waits: no dependency at all, the
            device's streaming bandwidth over the whole step (an upper bound, not a design)
    l2w     sends its bytes to L2, waits, lets the next launch, reads them: the next layer
            prefetches while this one reads (one layer ahead; `l2` lets every layer in at once,
            16 layers of prefetches against one L2)

beside `flashtune.attention_with_kvcache` on the same caches (MQA 8/1 or GQA 32/8, B=1, D=128,
bf16). If `l2` cannot reach a rate, no kernel that keeps the dependency can.

    python3 bench/overlap_ceiling.py --out overlap.jsonl [--cells 8/1/32768,8/1/131072]
    TRITON_INTERPRET=1 python3 bench/overlap_ceiling.py --device cpu   # a smoke run
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, sum_checked, time_steps  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashtune.bench.read_ceiling import read_sum  # noqa: E402

MODES = {"plain": 0, "wait": 1, "l2": 2, "early": 3, "l2w": 4}
LINE = 64  # bf16 elements in a 128-byte line


@triton.jit
def _pdl_read(X, Y, OUT, n, per_prog, pf_len, BLOCK: tl.constexpr, MODE: tl.constexpr,
              LINE: tl.constexpr, PF_LINES: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_prog
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 2 or MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 2 or MODE == 4:
        # one line a thread a step (a [32]-line tensor would be held, and sent, by 8 threads)
        end = tl.minimum(start + pf_len, n) - 1
        for off in range(start, start + pf_len, PF_LINES * LINE):
            lines = tl.minimum(off + tl.arange(0, PF_LINES) * LINE, end)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [X + lines], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [Y + lines], dtype=tl.int32, is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
    if MODE == 4:
        tl.extra.cuda.gdc_launch_dependents()
    acc = read_sum(X, Y, start, per_prog, n, BLOCK)
    if MODE == 3:
        tl.extra.cuda.gdc_wait()
    tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))


def reader(x, y, programs: int, mode: str, pdl: bool, shape=(8, 2048, 3)):
    """mode: a MODES name, l2w/K: l2w prefetching the first 1/K of each program's bytes.
    shape: (warps, elements a step, stages) of each program."""
    from flashtune.bench.read_ceiling import split
    warps, block, stages = shape
    n = x.numel()
    progs, per_prog = split(n, programs, block)
    mode, _, frac = mode.partition("/")
    pf_len = per_prog // int(frac or 1)
    extra = {"launch_pdl": True} if pdl and mode != "plain" else {}

    def read():
        out = torch.empty(progs, dtype=torch.float32, device=x.device)
        _pdl_read[(progs,)](x, y, out, n, per_prog, pf_len, BLOCK=block, MODE=MODES[mode],
                            LINE=LINE,
                            PF_LINES=32 * warps, num_warps=warps, num_stages=stages, **extra)
        return out
    return read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="overlap_ceiling.jsonl")
    ap.add_argument("--cells", default="8/1/8192,8/1/32768,8/1/131072,32/8/32768",
                    help="Hq/Hk/Nk,... (B=1, D=128)")
    ap.add_argument("--per-sm", default="1,2,4", help="programs per SM tried for each read")
    ap.add_argument("--modes", default="plain,wait,l2,early,l2w,l2w/2,l2w/4",
                    help=f"{','.join(MODES)}, l2w/K (l2w prefetching 1/K of the bytes)")
    ap.add_argument("--shapes", default="8/2048/3",
                    help="warps/elements a step/stages of the reads' programs,...")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import decode_bench as db
    import flashtune
    cuda = a.device == "cuda"
    db.GRAPH, db.DEVICE = cuda, a.device
    layers, d = (16, 128) if cuda else (2, 64)
    dt = torch.bfloat16 if cuda else torch.float16
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 2
    write = Rows(a.out, "cuda" if cuda else "cpu")
    for cell in a.cells.split(","):
        hq, hk, nk = (int(x) for x in cell.split("/"))
        if not cuda:
            nk = min(nk, 512)
        q = torch.randn(1, 1, hq, d, dtype=dt, device=a.device)
        kcs = [torch.randn(1, nk, hk, d, dtype=dt, device=a.device) for _ in range(layers)]
        vcs = [torch.randn_like(k) for k in kcs]
        sl = torch.full((1,), nk, dtype=torch.int32, device=a.device)
        kv_bytes = 2 * nk * hk * d * kcs[0].element_size()
        runs = {"flashtune": lambda i: (lambda: flashtune.attention_with_kvcache(
            q, kcs[i], vcs[i], cache_seqlens=sl))}
        for mode in a.modes.split(","):
            for per_sm in (int(x) for x in a.per_sm.split(",")):
                for sh in a.shapes.split(","):
                    shape = tuple(int(x) for x in sh.split("/"))
                    label = f"{mode} x{per_sm}" + ("" if sh == "8/2048/3" else f" {sh}")
                    runs[label] = (lambda m, p, h: lambda i: reader(
                        kcs[i], vcs[i], sms * p, m, cuda, h))(mode, per_sm, shape)
        want = (sum(k.double().sum().item() + v.double().sum().item()
                    for k, v in zip(kcs[:1], vcs[:1])))
        # the reads' sums are their check (flashtune's output is attention)
        ok = sum_checked(write, runs, want, nk, {"cell": cell}, lambda l: l == "flashtune")
        time_steps(write, ok, layers, a.reps, kv_bytes, {"cell": cell})
        q = kcs = vcs = runs = None
        if cuda:
            torch.cuda.empty_cache()
    write.close()


if __name__ == "__main__":
    main()
