"""A Gluon split-KV partial kernel for the MQA B=1 decode step (issue 9, session 36): K and V
tiles through a TMA ring completed on mbarriers, QK^T and PV on wgmma, one 4-warp program per SM.

Why: a Gluon reader with such a ring streams a 128k-key MQA step at 2,703 GB/s with one program
per SM (bench/tma_read_probe.py, H100), where Triton's pointer loads reach 2,412-2,473 with one
program per SM and the shipped partial kernel 2,469; the shipped step (with the combine) reads
2,399 against the issue's 2,600. A wgmma warpgroup owns 16 rows a warp, so the softmax's row max
and sum stay inside each warp (the shipped kernel reduces them across warps through shared
memory, seven barriers a key step).

The kernel writes the shipped partial kernel's O (rows, splits, D) and LSE (rows, splits), so
the shipped combine merges them (warp_split_probe.WarpSplit's launch). MQA, B=1, one query
token, the contiguous cache as an (N, D) TMA view; no PDL (its K/V loads would have to wait for
the kernel before, which may append to the cache).

    python3 bench/gluon_decode_probe.py --compile             # sm_90 compile, no GPU
    python3 bench/gluon_decode_probe.py --out gd.jsonl        # GPU: 16-layer graph steps
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, time_steps  # noqa: E402
from tma_read_probe import load_pair  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from flashtune.gluon_compat import sync_warps, tma_load  # noqa: E402


@gluon.jit
def _gl_partial(Q, K, V, k_desc, v_desc, O, LSE, sm_scale, seqlen, num_splits, stride_qh,
                pf_rows, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                SPLIT_KV: gl.constexpr, MATH: gl.constexpr = 2, EARLY: gl.constexpr = False):
    # EARLY (a programmatic dependent launch, the shipped early_start's order): the first
    # pf_rows rows of the split's K and V go to L2 (prefetches: a line the kernel before writes
    # later is updated in L2, never stale), then the wait for the kernel before, then the
    # combine may launch; TMA loads into shared memory only after the wait.
    # SPLIT_KV: K and V of a stage complete on barriers of their own, K's slot refilled once
    # S = Q K^T's wait returns (V may still be landing), V's after P V; no CTA barrier before a
    # refill (one warpgroup: its wgmma wait returning means its reads of the slot are done).
    # Else one barrier a stage, refilled after P V and a CTA barrier. MATH (timing only; the
    # output is wrong below 2): 2 the attention, 1 S = Q K^T alone, 0 no math (the ring alone).
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    cols_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    cols_o: gl.constexpr = gl.SliceLayout(0, mma_o)
    q_lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    split = gl.program_id(0)
    chunk = gl.cdiv(gl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    lo = gl.minimum(split * chunk, seqlen)
    hi = gl.minimum(lo + chunk, seqlen)
    n_steps = gl.cdiv(hi - lo, BLOCK_N)
    if EARLY:
        LINE: gl.constexpr = 64  # bf16 elements of a 128-byte line
        pf_lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        j = gl.arange(0, 128, layout=pf_lay)  # a line a thread a step
        n_lines = gl.minimum(pf_rows, hi - lo) * (D // LINE)
        for l0 in range(0, n_lines, 128):
            jj = gl.minimum(l0 + j, n_lines - 1)
            off = (lo + jj // (D // LINE)).to(gl.int64) * D + (jj % (D // LINE)) * LINE
            gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [K + off], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [V + off], dtype=gl.int32, is_pure=False, pack=1)
        gdc_wait()
        gdc_launch_dependents()
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
    for s in gl.static_range(STAGES):  # the ring's first tiles, before Q
        if s < n_steps:
            if SPLIT_KV:
                mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
                tma_load(k_desc, [lo + s * BLOCK_N, 0], ready.index(s), k_bufs.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma_load(v_desc, [lo + s * BLOCK_N, 0], v_ready.index(s), v_bufs.index(s))
            else:
                load_pair(k_desc, v_desc, lo + s * BLOCK_N, ready.index(s), k_bufs.index(s),
                          v_bufs.index(s))
    # Q: the GROUP q heads of the one kv head, rows padded to the wgmma's 64
    qr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_lay))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, q_lay))
    q = gl.load(Q + gl.expand_dims(qr, 1) * stride_qh + gl.expand_dims(qc, 0),
                mask=gl.expand_dims(qr < GROUP, 1), other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype))
    q_smem.store(q)
    fence_async_shared()
    sync_warps()
    qk_scale = sm_scale * 1.4426950408889634
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, mma_o)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_s)
    cols = gl.arange(0, BLOCK_N, layout=cols_s)
    st = 0
    ph = 0
    for i in range(n_steps):
        mbarrier.wait(ready.index(st), ph)
        nxt = i + STAGES
        if MATH == 2:
            sc = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            if SPLIT_KV:
                if nxt < n_steps:
                    mbarrier.expect(ready.index(st), k_desc.block_type.nbytes)
                    tma_load(k_desc, [lo + nxt * BLOCK_N, 0], ready.index(st), k_bufs.index(st))
            # the split's last tile runs into the next split's keys
            ok = (lo + i * BLOCK_N + cols) < hi
            qk = gl.where(gl.expand_dims(ok, 0), sc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(qk, 1))
            p = gl.exp2(qk - gl.expand_dims(m_new, 1))  # a step has a key: m_new is finite
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            if SPLIT_KV:
                mbarrier.wait(v_ready.index(st), ph)
            acc = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            m_i = m_new
            if SPLIT_KV:
                if nxt < n_steps:
                    mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
                    tma_load(v_desc, [lo + nxt * BLOCK_N, 0], v_ready.index(st),
                             v_bufs.index(st))
        elif MATH == 1:  # S = Q K^T alone (timing only)
            sc = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            l_i = l_i + gl.sum(sc, 1)
        else:  # no math: the ring alone (timing only)
            l_i = l_i + 1.0
        if not SPLIT_KV or MATH < 2:
            sync_warps()  # every warp's wgmmas are done with the slot before it is refilled
            if nxt < n_steps:
                load_pair(k_desc, v_desc, lo + nxt * BLOCK_N, ready.index(st), k_bufs.index(st),
                          v_bufs.index(st))
        st += 1
        if st == STAGES:
            st = 0
            ph ^= 1
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
    seen = l_i > 0.0  # a split without keys: O = 0, LSE = -inf (the combine weighs it 0)
    l_safe = gl.where(seen, l_i, 1.0)
    m_safe = gl.where(seen, m_i, 0.0)
    lse = gl.where(seen, (m_safe + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    rs = gl.arange(0, BLOCK_M, layout=rows_s)
    gl.store(LSE + rs * num_splits + split, lse, mask=rs < GROUP)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)
    ro = gl.arange(0, BLOCK_M, layout=rows_o)
    co = gl.arange(0, D, layout=cols_o)
    gl.store(O + (gl.expand_dims(ro, 1) * num_splits + split) * D + gl.expand_dims(co, 0), o,
             mask=gl.expand_dims(ro < GROUP, 1))


def _layout(rows: int, d: int):
    return gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)


class GluonSplit:
    """The prototype's launch for q (1, 1, G, D) and caches (1, N, 1, D): run(q, k, v, n) ->
    O, LSE as SplitKVPlan.run, merged by the shipped combine (combine=False: the partial kernel
    alone)."""

    def __init__(self, q, block_n: int, stages: int, splits: int, combine: bool = True,
                 pdl: bool = True, split_kv: bool = False, math: int = 2,
                 early: bool = False):
        from flashtune.codegen import Variant, load
        from flashtune.launch_splitkv import combine_tile
        self.g, self.d = q.shape[2], q.shape[3]
        self.block_n, self.stages, self.splits = block_n, stages, splits
        self.combine, self.pdl, self.split_kv, self.math = combine, pdl, split_kv, math
        self.early = early and pdl
        # the shipped early start's budget: 2 MiB over all programs (launch_splitkv.PREFETCH_BYTES)
        self.pf_rows = (2 << 20) // (splits * 2 * self.d * 2)
        self.mod = load(Variant("splitkv", block_m=64, block_n=64, num_warps=4, num_stages=3,
                                early_start=early))
        self.block_s, self.chunk_d = combine_tile(splits, self.d)
        self.lay = _layout(block_n, self.d)
        self.descs = {}
        self.name = (f"gluon n{block_n} s{stages} sp{splits}" + (" kv" if split_kv else "")
                     + ("" if math == 2 else f" math{math}") + (" early" if early else ""))

    def _desc(self, t):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        key = t.data_ptr()
        if key not in self.descs:
            n = t.shape[1]
            self.descs[key] = TensorDescriptor(t.view(n, self.d), [n, self.d], [self.d, 1],
                                               [self.block_n, self.d], self.lay)
        return self.descs[key]

    def run(self, q, k, v, n: int):
        g, d, s = self.g, self.d, self.splits
        o_part = torch.empty((g, s, d), dtype=torch.float32, device=q.device)
        l_part = torch.empty((g, s), dtype=torch.float32, device=q.device)
        extra = {"launch_pdl": True} if self.early else {}
        _gl_partial[(s,)](q, k, v, self._desc(k), self._desc(v), o_part, l_part,
                          1.0 / d ** 0.5, n, s, q.stride(2), self.pf_rows, GROUP=g, BLOCK_M=64,
                          STAGES=self.stages, SPLIT_KV=self.split_kv, MATH=self.math,
                          EARLY=self.early, num_warps=4, **extra)
        from warp_split_probe import combined
        return combined(self, q, o_part, l_part, s, self.early)


def compile_only(configs) -> None:
    from codegen.aot import compile_for
    for bn, st, kv, math, early in configs:
        ty = f"tensordesc<bf16[{bn},128],{_layout(bn, 128)!r}>"
        out = compile_for(_gl_partial, {"GROUP": 8, "BLOCK_M": 64, "STAGES": st,
                                          "SPLIT_KV": kv, "MATH": math, "EARLY": early},
                          "bfloat16",
                          4, 1, usage=True,
                          types={"k_desc": ty, "v_desc": ty, "Q": "*bf16", "K": "*bf16",
                                 "V": "*bf16", "O": "*fp32", "LSE": "*fp32", "seqlen": "i32",
                                 "num_splits": "i32", "stride_qh": "i32", "pf_rows": "i32"})
        print(f"n{bn} s{st}" + (" kv" if kv else "") + f" math{math}"
              + (" early" if early else ""), "smem", out["smem"], "regs",
              out.get("regs"), "spill", out.get("spill_bytes"), out.get("wgmma"))


def gpu(out: str, cells, configs, reps: int) -> None:
    import decode_bench as db
    from flashtune.reference import reference
    from warp_split_probe import shipped_runs
    db.GRAPH, db.DEVICE = True, "cuda"
    layers, d, g = 16, 128, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    write = Rows(out)
    for nk in cells:
        q = torch.randn(1, 1, g, d, dtype=torch.bfloat16, device="cuda")
        kcs = [torch.randn(1, nk, 1, d, dtype=torch.bfloat16, device="cuda")
               for _ in range(layers)]
        vcs = [torch.randn_like(k) for k in kcs]
        sl = torch.full((1,), nk, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * nk * d * 2
        var, runs = shipped_runs(q, kcs, vcs, sl, nk)
        for bn, st, x, kv, math, early in configs:
            for comb in ((True, False) if math == 2 else (False,)):
                gs = GluonSplit(q, bn, st, sms * x, combine=comb, split_kv=kv, math=math,
                                early=early)
                runs[gs.name + ("" if comb else "+nocomb")] = (
                    lambda w: lambda i: w.run(q, kcs[i], vcs[i], nk))(gs)
        # float64 reference of layer 0 (MQA: every q head reads the one kv head)
        kk, vv = (t[0, :, 0].double() for t in (kcs[0], vcs[0]))
        ref = reference(q.transpose(1, 2).double(), kk.expand(1, g, nk, d),
                        vv.expand(1, g, nk, d)).reshape(g, d)
        times = {}
        for label, run in runs.items():
            try:
                got = run(0)[0]
                torch.cuda.synchronize()
                err = (got.double().reshape(g, d) - ref).abs().max().item()
                write({"Nk": nk, "impl": label, "max_err_vs_f64": err})
                if "nocomb" in label or err < 2e-2:  # (math0/1: nocomb, timed unchecked)
                    times[label] = []
            except Exception as e:  # noqa: BLE001 -- a config that cannot build is a row
                write({"Nk": nk, "impl": label, "error": f"{type(e).__name__}: {e}"[:400]})
        time_steps(write, {label: (lambda r: lambda i: lambda: r(i))(runs[label])
                           for label in times}, layers, reps, kv_bytes, {"Nk": nk})
        q = kcs = vcs = runs = None
        torch.cuda.empty_cache()
    write.close()


def parse(text: str) -> tuple:
    """(BLOCK_N, STAGES, programs per SM, split K/V barriers, MATH) of one --configs entry."""
    bn, st, x, *rest = text.split("/")
    if set(rest) - {"kv", "m0", "m1", "e"}:
        raise SystemExit(f"--configs: {text!r}: flags are kv, m0, m1, e")
    math = 0 if "m0" in rest else 1 if "m1" in rest else 2
    return int(bn), int(st), int(x), "kv" in rest, math, "e" in rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gluon_decode.jsonl")
    ap.add_argument("--cells", default="32768,131072", help="key counts (MQA 8/1, B=1, D=128)")
    ap.add_argument("--configs", default="64/2/1,64/3/1,64/4/1,128/2/1",
                    help="BLOCK_N/STAGES/programs per SM[/kv][/m0|/m1][/e],... (kv: K and V on "
                         "barriers of their own, K refilled after QK^T; m1: QK^T alone, m0: no "
                         "math -- timed without the combine, unchecked; e: the early start)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only")
    a = ap.parse_args()
    configs = [parse(c) for c in a.configs.split(",")]
    if a.compile:
        compile_only([(bn, st, kv, m, e) for bn, st, _, kv, m, e in configs])
        return
    gpu(a.out, [int(x) for x in a.cells.split(",")], configs, a.reps)


if __name__ == "__main__":
    main()
