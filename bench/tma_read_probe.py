"""Does a deep TMA ring let one program per SM stream a decode step's bytes as fast as several
programs do? (issue 9, session 36.) The MQA B=1 partial kernel reads 2,469 GB/s at 128k keys
alone, as fast as the best plain read with one program per SM (bench/overlap_ceiling.py
--shapes: 2,254-2,473) but not the 2,680-2,760 of two or four per SM; attention kernels with
two per SM (num_splits 264) read slower still (2,385), so its one-program-per-SM grid is kept
and the bytes in flight per SM must come from elsewhere. Here a Gluon reader keeps STAGES
(BLOCK_R, D) tiles of K and V in flight per program through TMA loads completed on mbarriers
(no warps needed to hold them), its warps reading each tile from shared memory as a decode
kernel's MMAs would, beside the Triton reader (overlap_ceiling.reader) in the same 16-layer
CUDA-graph steps.

    python3 bench/tma_read_probe.py --out tma_read.jsonl [--configs 64/4/1,128/6/1,...]
    python3 bench/tma_read_probe.py --compile   # sm_90 compile of each config, no GPU
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, sum_checked, time_steps  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from flashtune.gluon_compat import sync_warps, tma_load  # noqa: E402


@gluon.jit
def load_pair(x_desc, y_desc, row, bar, x_buf, y_buf):
    # a tile of X and one of Y at `row` into one ring slot, both completing one barrier
    mbarrier.expect(bar, x_desc.block_type.nbytes + y_desc.block_type.nbytes)
    tma_load(x_desc, [row, 0], bar, x_buf)
    tma_load(y_desc, [row, 0], bar, y_buf)


# MODE (session 44): the read launched as a programmatic dependent, in the orders an attention
# layer may keep. 0 plain (no PDL); 1 pre: the ring's STAGES tiles issued, then the wait, then a
# read of the layer before's output (PREV: an attention layer's query), the next layer let in,
# the tiles consumed (each scaled by a factor taken from PREV, so the first waits for it);
# 2 pretf: as pre, the next layer let in first; 3 early: no dependency (the wait at the end)
MODES = {"plain": 0, "pre": 1, "pretf": 2, "early": 3}


@gluon.jit
def _tma_read(x_desc, y_desc, OUT, PREV, O_PART, LSE_PART, rows_per_prog, n_rows, n_parts,
              STAGES: gl.constexpr, READ: gl.constexpr, WARPS: gl.constexpr,
              MODE: gl.constexpr, PART: gl.constexpr):
    # PART: each program also stores a split-KV partial as the MQA B=1 partial kernel does (8
    # rows of D float32 at split = its id, O_PART (8, n_parts, D), and an LSE of 0 for each,
    # LSE_PART (8, n_parts)), for the shipped combine to merge after it
    # program p streams rows [p * rows_per_prog, ...) of X and Y (n_rows x D), rows_per_prog a
    # multiple of BLOCK_R: STAGES tiles of each in flight, a tile's slot refilled once every
    # warp has read it (READ: into registers, summed, the check; else the ring alone)
    BLOCK_R: gl.constexpr = x_desc.block_type.shape[0]
    D: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    pid = gl.program_id(0)
    r0 = pid * rows_per_prog
    n_steps = gl.cdiv(gl.minimum(rows_per_prog, n_rows - r0), BLOCK_R)
    xb = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, D], x_desc.layout)
    yb = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, D], y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    if MODE >= 2:
        gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        if s < n_steps:
            load_pair(x_desc, y_desc, r0 + s * BLOCK_R, ready.index(s), xb.index(s), yb.index(s))
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    acc = gl.zeros([BLOCK_R, D], gl.float32, layout)
    scale = 1.0
    if MODE == 1 or MODE == 2:
        gdc_wait()
        if MODE == 1:
            gdc_launch_dependents()
        # a per-program sum of the layer before: finite, so the factor is 1 (the sums check)
        scale = gl.where(gl.load(PREV) > 3.0e38, 2.0, 1.0)
    st = 0
    ph = 0
    for i in range(n_steps):
        mbarrier.wait(ready.index(st), ph)
        if READ:
            acc += (xb.index(st).load(layout).to(gl.float32)
                    + yb.index(st).load(layout).to(gl.float32)) * scale
        sync_warps()  # every warp is done with the slot before it is refilled
        nxt = i + STAGES
        if nxt < n_steps:
            load_pair(x_desc, y_desc, r0 + nxt * BLOCK_R, ready.index(st), xb.index(st),
                      yb.index(st))
        st += 1
        if st == STAGES:
            st = 0
            ph ^= 1
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    if MODE == 3:
        gdc_wait()
    gl.store(OUT + pid, gl.sum(gl.sum(acc, 1), 0))
    if PART:
        r8 = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
        cd = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        part = gl.expand_dims(gl.sum(acc, 0), 0) + gl.zeros([8, D], gl.float32, layout)
        gl.store(O_PART + (gl.expand_dims(r8, 1) * n_parts + pid) * D + gl.expand_dims(cd, 0),
                 part)
        gl.store(LSE_PART + r8 * n_parts + pid,
                 gl.zeros([8], gl.float32, gl.SliceLayout(1, layout)))


def _layout(block_r: int, d: int):
    return gl.NVMMASharedLayout.get_default_for([block_r, d], gl.bfloat16)


def tma_reader(x, y, programs: int, block_r: int, stages: int, read: bool = True,
               warps: int = 4, mode: str = "plain", prev=None, out=None, combine=None):
    """A callable streaming x and y ((N, D) contiguous bf16 views of one layer's K and V) with
    `programs` programs, returning per-program sums (float32). mode: a MODES name; prev: the
    float32 tensor whose first element a dependent mode reads after its wait (the layer
    before's `out`); out: the tensor the sums go to (a fresh one each call if None); combine:
    (launch, o_part, lse_part, o, lse), the shipped combine's launcher and its buffers, run
    after the read on partials the read stores (PART), its output `o` the next layer's prev."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    n, d = x.shape
    per = -(-n // programs)
    per = -(-per // block_r) * block_r
    progs = -(-n // per)
    lay = _layout(block_r, d)
    xd = TensorDescriptor(x, [n, d], [d, 1], [block_r, d], lay)
    yd = TensorDescriptor(y, [n, d], [d, 1], [block_r, d], lay)

    extra = {"launch_pdl": True} if mode != "plain" else {}

    def read_():
        o = out if out is not None else torch.empty(progs, dtype=torch.float32, device=x.device)
        parts = (combine[1], combine[2]) if combine else (o, o)
        _tma_read[(progs,)](xd, yd, o, prev if prev is not None else o, *parts, per, n, progs,
                            STAGES=stages, READ=read, WARPS=warps, MODE=MODES[mode],
                            PART=combine is not None, num_warps=warps, **extra)
        if combine:
            launch, o_part, l_part, co, lse = combine
            launch(progs, o_part, l_part, co, lse)
        return o
    return read_


def combine_launcher(nk: int):
    """The shipped combine (the gluon record's early render: it lets the next kernel launch
    before its own wait) for MQA B=1 at nk keys: launch(splits, o_part, lse_part, o, lse)."""
    from flashtune.codegen import Variant
    from flashtune.launch_splitkv import SplitKVPlan, combine_tile
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    kc = torch.empty(1, nk, 1, 128, dtype=torch.bfloat16, device="cuda")
    plan = SplitKVPlan(q, kc, False, None, Variant.parse("splitkv-m64-n128-w4-s2-gluon=true"))

    def launch(splits, o_part, l_part, o, lse):
        chunk = combine_tile(splits, 128)[1]
        plan._launcher(("combine", splits, True, True))(
            (8, 128 // chunk), o_part, l_part, o, lse, 8, 1, splits, o.stride(0), o.stride(1),
            o.stride(2))
    return launch


def combine_parts(launch, programs: int) -> tuple:
    """A layer's combine (launch: combine_launcher's) with its buffers, for a read of at most
    `programs` programs (its splits: as many as the read has programs): (launch, o_part,
    lse_part, o, lse)."""
    o_part = torch.zeros(8, programs, 128, dtype=torch.float32, device="cuda")
    l_part = torch.zeros(8, programs, dtype=torch.float32, device="cuda")
    o = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(1, 8, 1, dtype=torch.float32, device="cuda")
    return launch, o_part, l_part, o, lse


def parse(text: str) -> tuple:
    """BLOCK_R/STAGES/programs-per-SM[/noread][/wN][/MODE][/comb]"""
    r, s, x, *rest = text.split("/")
    read, warps, mode, comb = "noread" not in rest, 4, "plain", False
    for t in rest:
        if t.startswith("w") and t[1:].isdigit():
            warps = int(t[1:])
        elif t in MODES:
            mode = t
        elif t == "comb":
            comb = True
        elif t != "noread":
            raise SystemExit(f"--configs: {text!r}: {t!r} is not noread, comb, wN or one of "
                             f"{list(MODES)}")
    return int(r), int(s), int(x), read, warps, mode, comb


def compile_only(configs) -> None:
    from codegen.aot import compile_for
    for text in configs:
        r, s, _, read, warps, mode, comb = parse(text)
        ty = f"tensordesc<bf16[{r},128],{_layout(r, 128)!r}>"
        out = compile_for(_tma_read, {"STAGES": s, "READ": read, "WARPS": warps,
                                      "MODE": MODES[mode], "PART": comb}, "bfloat16",
                          warps, 1, usage=True,
                          types={"x_desc": ty, "y_desc": ty, "OUT": "*fp32", "PREV": "*fp32",
                                 "O_PART": "*fp32", "LSE_PART": "*fp32", "n_parts": "i32",
                                 "rows_per_prog": "i32", "n_rows": "i32"})
        print(text, "smem", out["smem"], "regs", out.get("regs"), "spill", out.get("spill_bytes"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tma_read.jsonl")
    ap.add_argument("--cells", default="32768,131072", help="key counts (MQA 8/1, B=1, D=128)")
    ap.add_argument("--configs", default="64/2/1,64/4/1,64/6/1,128/3/1,128/4/1,64/4/2,"
                    "64/4/1/noread,128/4/1/noread,64/4/1/w8",
                    help="BLOCK_R/STAGES/programs per SM[/noread][/wN],...")
    ap.add_argument("--triton-modes", default="",
                    help="overlap_ceiling orders of the 4-an-SM Triton read also timed (l2w/2,early)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="compile each config for sm_90 only")
    a = ap.parse_args()
    configs = a.configs.split(",")
    if a.compile:
        compile_only(configs)
        return
    import decode_bench as db
    from overlap_ceiling import reader

    import flashtune
    db.GRAPH, db.DEVICE = True, "cuda"
    layers, d = 16, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    write = Rows(a.out)
    for nk in (int(x) for x in a.cells.split(",")):
        kcs = [torch.randn(nk, d, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        vcs = [torch.randn_like(k) for k in kcs]
        kv_bytes = 2 * nk * d * 2
        runs = {f"triton x{p} {sh}": (lambda p, sh: lambda i: reader(
            kcs[i], vcs[i], sms * p, "plain", False, tuple(int(x) for x in sh.split("/"))))(p, sh)
            for p, sh in ((1, "16/8192/2"), (2, "4/8192/3"), (4, "16/4096/3"))}
        # session 36's best dependency-keeping Triton read (l2w/2 x4) and its no-dependency
        # order, and the shipped decode step on the same caches, for the same run
        for mode in a.triton_modes.split(","):
            if mode:
                runs[f"triton {mode} x4"] = (lambda m: lambda i: reader(
                    kcs[i], vcs[i], sms * 4, m, True))(mode)
        q = torch.randn(1, 1, 8, d, dtype=torch.bfloat16, device="cuda")
        sl = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        runs["flashtune"] = lambda i: (lambda: flashtune.attention_with_kvcache(
            q, kcs[i].view(1, nk, 1, d), vcs[i].view(1, nk, 1, d), cache_seqlens=sl))
        for text in configs:
            r, s, x, read, warps, mode, comb = parse(text)
            # each layer's sums in its own buffer; a dependent mode reads the layer before's
            # (with comb: its combine's output)
            outs = [torch.zeros(2 * sms * x, dtype=torch.float32, device="cuda")
                    for _ in range(layers)]
            launch = combine_launcher(nk) if comb else None
            combs = [combine_parts(launch, sms * x) if comb else None for _ in range(layers)]
            runs[f"tma {text}"] = (lambda r, s, x, rd, w, m, outs, combs: lambda i: tma_reader(
                kcs[i], vcs[i], sms * x, r, s, rd, w, m,
                combs[i - 1][3] if combs[i] else outs[i - 1], outs[i], combs[i]))(
                r, s, x, read, warps, mode, outs, combs)
        want = kcs[0].double().sum().item() + vcs[0].double().sum().item()
        ok = sum_checked(write, runs, want, nk, {"Nk": nk},
                         lambda l: "noread" in l or l == "flashtune")
        time_steps(write, ok, layers, a.reps, kv_bytes, {"Nk": nk})
        kcs = vcs = runs = None
        torch.cuda.empty_cache()
    write.close()


if __name__ == "__main__":
    main()
