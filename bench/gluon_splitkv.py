"""The Gluon split-KV partial kernel of bench/gluon_decode_probe.py (MQA B=1 there) for the whole
contiguous-cache contract of the splitkv family: batches, kv heads, GQA groups, several query
tokens (causal aligned bottom-right), per-sequence lengths, the early start -- a step towards a
Gluon render of the family (issue 9, session 36), not yet wired into it.

GluonKVPlan is launch_splitkv.SplitKVPlan with its partial kernel swapped: the plan's own run()
decides the splits, the early start, the scratch and the combine, and calls the partial
launcher with the shipped kernel's arguments, which _Partial maps onto this kernel's. K and V
reach it as TMA descriptors over the (B * Ncache, Hk * D) view of a contiguous cache: a tile is
BLOCK_N keys of one kv head, at column hk * D. Not paged, no masks beyond causal, bf16/fp16,
GROUP x Nq <= 64 (one 64-row wgmma tile).

    python3 bench/gluon_splitkv.py --compile            # sm_90 compile, no GPU
    python3 bench/gluon_splitkv.py --out gkv.jsonl      # GPU: 16-layer steps, shipped beside
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from flashtune.gluon_compat import sync_warps, tma_load  # noqa: E402
from flashtune.launch_splitkv import SplitKVPlan  # noqa: E402

ROWS_ = 64  # a 4-warp wgmma's M
ROWS = gl.constexpr(ROWS_)


@gluon.jit
def _kv_partial(Q, K, V, k_desc, v_desc, SEQLENS, O, LSE, sm_scale,
                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                stride_ob, stride_om, stride_oh, stride_os,
                stride_lb, stride_lm, stride_lh, stride_ls,
                HK, Nq, num_splits, n_cache, max_keys, hint_keys, pf_rows,
                GROUP: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                UNIFORM: gl.constexpr, EARLY: gl.constexpr):
    # grid (B * HK, num_splits). Rows r = g * Nq + i (q head hk * GROUP + g, token i), r <
    # GROUP * Nq. Split s of a sequence of L keys: [s * chunk, min(L, (s + 1) * chunk)), chunk =
    # cdiv(cdiv(L, num_splits), BLOCK_N) * BLOCK_N (the shipped kernel's). Token i sees key j iff
    # j <= i + L - Nq when causal. O / LSE through strides: float32 scratch (rows, splits) or,
    # one split, the final O and LSE. EARLY: the shipped early start's order (prefetches of the
    # first pf_rows rows as hint_keys places the split, the wait, then the next kernel may
    # launch); nothing the kernel before writes is read before the wait.
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
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // HK
    hk = pid % HK
    if EARLY:
        LINE: gl.constexpr = 64  # 2-byte elements of a 128-byte line
        pf_lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        chunk_h = gl.cdiv(gl.cdiv(hint_keys, num_splits), BLOCK_N) * BLOCK_N
        lo_h = gl.minimum(split * chunk_h, hint_keys)
        n_lines = gl.minimum(pf_rows, gl.minimum(lo_h + chunk_h, hint_keys) - lo_h) * (D // LINE)
        kbase = b.to(gl.int64) * stride_kb + hk.to(gl.int64) * stride_kh
        j = gl.arange(0, 128, layout=pf_lay)  # a line a thread a step
        for l0 in range(0, n_lines, 128):
            jj = gl.minimum(l0 + j, n_lines - 1)
            off = kbase + (lo_h + jj // (D // LINE)).to(gl.int64) * stride_kn \
                + (jj % (D // LINE)) * LINE
            gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [K + off], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [V + off], dtype=gl.int32, is_pure=False, pack=1)
        gdc_wait()
        gdc_launch_dependents()
    if UNIFORM:
        L = max_keys
    else:
        L = gl.minimum(gl.load(SEQLENS + b), max_keys)
    chunk = gl.cdiv(gl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    lo = gl.minimum(split * chunk, L)
    hi = gl.minimum(lo + chunk, L)
    n_steps = gl.cdiv(hi - lo, BLOCK_N)
    row0 = b * n_cache + lo  # the descriptor's row of the split's first key
    col = hk * D
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
    for s in gl.static_range(STAGES):  # the ring's first tiles, then Q
        if s < n_steps:
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma_load(k_desc, [row0 + s * BLOCK_N, col], k_ready.index(s), k_bufs.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma_load(v_desc, [row0 + s * BLOCK_N, col], v_ready.index(s), v_bufs.index(s))
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_lay))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, q_lay))
    q_off = (b.to(gl.int64) * stride_qb + (qr % Nq) * stride_qm
             + (hk * GROUP + qr // Nq) * stride_qh)
    q = gl.load(Q + gl.expand_dims(q_off, 1) + gl.expand_dims(qc, 0),
                mask=gl.expand_dims(qr < GROUP * Nq, 1), other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, D],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype))
    q_smem.store(q)
    fence_async_shared()
    sync_warps()
    qk_scale = sm_scale * 1.4426950408889634
    rs = gl.arange(0, ROWS, layout=rows_s)
    last = gl.expand_dims(rs % Nq + L - Nq, 1)  # causal: the last key a row sees
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([ROWS], gl.float32, rows_s)
    acc = gl.zeros([ROWS, D], gl.float32, mma_o)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, mma_s)
    cols = gl.arange(0, BLOCK_N, layout=cols_s)
    st = 0
    ph = 0
    for i in range(n_steps):
        mbarrier.wait(k_ready.index(st), ph)
        sc = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc,))
        nxt = i + STAGES
        if nxt < n_steps:  # K's slot is free once S = Q K^T is read (one warpgroup)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma_load(k_desc, [row0 + nxt * BLOCK_N, col], k_ready.index(st), k_bufs.index(st))
        kj = gl.expand_dims(lo + i * BLOCK_N + cols, 0)
        ok = kj < hi  # the split's last tile runs into the next split's keys
        if IS_CAUSAL:
            ok = ok & (kj <= last)
        qk = gl.where(ok, sc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
        p = gl.exp2(qk - gl.expand_dims(m_sub, 1))
        alpha = gl.exp2(m_i - m_sub)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_ready.index(st), ph)
        acc = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        m_i = m_new
        if nxt < n_steps:
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma_load(v_desc, [row0 + nxt * BLOCK_N, col], v_ready.index(st), v_bufs.index(st))
        st += 1
        if st == STAGES:
            st = 0
            ph ^= 1
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
    seen = l_i > 0.0  # no key (a split past the end, a causal row): O = 0, LSE = -inf
    l_safe = gl.where(seen, l_i, 1.0)
    m_safe = gl.where(seen, m_i, 0.0)
    lse = gl.where(seen, (m_safe + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    l_off = (b.to(gl.int64) * stride_lb + (hk * GROUP + rs // Nq) * stride_lh
             + (rs % Nq) * stride_lm + split * stride_ls)
    gl.store(LSE + l_off, lse, mask=rs < GROUP * Nq)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)
    ro = gl.arange(0, ROWS, layout=rows_o)
    co = gl.arange(0, D, layout=cols_o)
    o_off = (b.to(gl.int64) * stride_ob + (hk * GROUP + ro // Nq) * stride_oh
             + (ro % Nq) * stride_om + split * stride_os)
    gl.store(O + gl.expand_dims(o_off, 1) + gl.expand_dims(co, 0), o.to(O.dtype.element_ty),
             mask=gl.expand_dims(ro < GROUP * Nq, 1))


def _layout(block_n: int, d: int, dtype: torch.dtype):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)


def blocker(q, k_cache, v_cache, variant) -> str:
    """Why this kernel cannot serve the call ("" when it can)."""
    b, nq, h, d = q.shape
    hk = k_cache.shape[2]
    if variant.paged or variant.window or variant.softcap or variant.block_sparse:
        return "paged caches and masks beyond causal are not rendered"
    if q.dtype not in (torch.bfloat16, torch.float16) or d not in (64, 128):
        return "bf16/fp16 with D 64 or 128 only"
    if (h // hk) * nq > ROWS_:
        return f"GROUP x Nq = {(h // hk) * nq} rows > {ROWS_}"
    for t in (k_cache, v_cache):
        n = t.shape[1]
        if t.stride() != (n * hk * d, hk * d, d, 1) or t.data_ptr() % 16:
            return "a cache that is not contiguous and 16-byte aligned"
    return ""


class _Partial:
    """The partial launcher SplitKVPlan.run calls, with the shipped kernel's arguments, mapped
    onto _kv_partial's (its K/V descriptors made per call, Gluon's checks once per shape)."""

    def __init__(self, plan, uniform: bool, early: bool):
        self.plan, self.uniform, self.early = plan, uniform, early

    def __call__(self, grid, q, k, v, bt, seqlens, o, lse, scale, sqb, sqm, sqh, skb, skn, skh,
                 svb, svn, svh, sbt, sob, som, soh, sos, slb, slm, slh, sls, hk, nq, s,
                 num_pages, max_keys, *early_args):
        from flashtune.launcher import gluon_desc
        if v.stride() != k.stride():  # the prefetches address V with K's strides
            raise ValueError("gluon splitkv: k_cache and v_cache strides differ")
        p = self.plan
        n, d = k.shape[1], k.shape[3]
        lay = _layout(p.gl_block_n, d, k.dtype)
        descs = [gluon_desc(t, [t.shape[0] * n, hk * d], [hk * d, 1], [p.gl_block_n, d], lay)
                 for t in (k, v)]
        hint, pf_rows = (early_args[0], early_args[1]) if self.early else (0, 0)
        extra = {"launch_pdl": True} if self.early else {}
        _kv_partial[grid](q, k, v, *descs, seqlens if seqlens is not None else o, o, lse,
                          scale, sqb, sqm, sqh, skb, skn, skh, sob, som, soh, sos,
                          slb, slm, slh, sls, hk, nq, s, n, max_keys, hint, pf_rows,
                          GROUP=p.kwargs["GROUP"], STAGES=p.gl_stages,
                          IS_CAUSAL=p.kwargs["IS_CAUSAL"], UNIFORM=self.uniform,
                          EARLY=self.early, num_warps=4, **extra)


class GluonKVPlan(SplitKVPlan):
    """SplitKVPlan with the Gluon partial kernel (the variant's block_n and num_stages give its
    tile and ring; one 64-row tile per (sequence, kv head)); raises ValueError where blocker()
    says it cannot serve."""

    def __init__(self, q, k_cache, causal, scale, variant, stages: int | None = None):
        super().__init__(q, k_cache, causal, scale, variant)
        why = blocker(q, k_cache, k_cache, variant)
        if why:
            raise ValueError(f"gluon splitkv: {why}")
        self.gl_block_n = variant.block_n
        self.gl_stages = stages or variant.num_stages
        b, _, h, _ = q.shape
        self.programs = b * k_cache.shape[2]  # one row tile: the grid's first axis

    def _launcher(self, key):
        if key[0] == "partial":
            return _Partial(self, key[1], key[2])
        return super()._launcher(key)


def compile_only(configs) -> None:
    from codegen.aot import compile_for
    for bn, st, early, causal in configs:
        ty = f"tensordesc<bf16[{bn},128],{_layout(bn, 128, torch.bfloat16)!r}>"
        out = compile_for(_kv_partial, {"GROUP": 8, "STAGES": st, "IS_CAUSAL": causal,
                                        "UNIFORM": False, "EARLY": early},
                          "bfloat16", 4, 1, usage=True,
                          types={"k_desc": ty, "v_desc": ty, "Q": "*bf16", "K": "*bf16",
                                 "V": "*bf16", "SEQLENS": "*i32", "O": "*fp32", "LSE": "*fp32",
                                 "HK": "i32"})
        print(f"n{bn} s{st}" + (" early" if early else "") + (" causal" if causal else ""),
              "smem", out["smem"], "regs", out.get("regs"), "spill", out.get("spill_bytes"),
              out.get("wgmma"))


def gpu(out: str, cells, configs, reps: int) -> None:
    """16-layer steps: the shipped plan (as dispatched: its variant, the early start where the
    launch takes it) beside this kernel at each (BLOCK_N, STAGES), each checked against the
    shipped output first."""
    import decode_bench as db
    from flashtune import kvcache
    from flashtune.codegen import Variant
    import dataclasses
    db.GRAPH, db.DEVICE = True, "cuda"
    layers, d = 16, 128
    f = open(out, "w")

    def write(row):
        f.write(json.dumps(row) + "\n")
        f.flush()
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
               if k != "ms_all"}, flush=True)
    write({"kind": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__})
    for cell in cells:
        b, hq, hk, nk = (int(x) for x in cell.split("/"))
        q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16, device="cuda")
        kcs = [torch.randn(b, nk, hk, d, dtype=torch.bfloat16, device="cuda")
               for _ in range(layers)]
        vcs = [torch.randn_like(k) for k in kcs]
        sl = torch.full((b,), nk, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * b * nk * hk * d * 2
        var = kvcache._variant(q, kcs[0], vcs[0], False, False, nk)
        plans = {f"{var.name} shipped": SplitKVPlan(q, kcs[0], False, None, var)}
        for bn, st in configs:
            gv = dataclasses.replace(var, block_n=bn, num_stages=st)
            plans[f"gluon n{bn} s{st} (splits of {var.name})"] = GluonKVPlan(
                q, kcs[0], False, None, gv)
        ref = plans[f"{var.name} shipped"].run(q, kcs[0], vcs[0], sl, None, nk)[0]
        times = {}
        for label, plan in plans.items():
            try:
                got = plan.run(q, kcs[0], vcs[0], sl, None, nk)[0]
                torch.cuda.synchronize()
                diff = (got.float() - ref.float()).abs().max().item()
                write({"cell": cell, "impl": label, "splits": plan.num_splits(nk),
                       "early": plan.early(plan.num_splits(nk)), "max_diff_vs_shipped": diff})
                if diff < 2e-2:
                    times[label] = []
            except Exception as e:  # noqa: BLE001 -- a config that cannot run is a row
                write({"cell": cell, "impl": label, "error": f"{type(e).__name__}: {e}"[:400]})
        for _ in range(reps):
            for label in times:
                times[label].append(db.bench_ms(db.layered(
                    lambda i, p=plans[label]: (lambda: p.run(q, kcs[i], vcs[i], sl, None, nk)),
                    layers)) / layers)
        for label, ts in times.items():
            ms = statistics.median(ts)
            write({"cell": cell, "impl": label, "ms": ms, "ms_all": ts,
                   "gbps": kv_bytes / ms / 1e6})
        q = kcs = vcs = plans = ref = None
        torch.cuda.empty_cache()
    f.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gluon_splitkv.jsonl")
    ap.add_argument("--cells", default="1/8/1/32768,1/8/1/131072,1/32/8/32768,8/32/8/8192,"
                    "8/8/1/32768,32/32/8/8192", help="B/Hq/Hk/Nk,... (D=128, one query token)")
    ap.add_argument("--configs", default="64/2", help="BLOCK_N/STAGES,...")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only")
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split("/")) for c in a.configs.split(",")]
    if a.compile:
        compile_only([(bn, st, e, c) for bn, st in configs for e in (False, True)
                      for c in (False, True)])
        return
    gpu(a.out, a.cells.split(","), configs, a.reps)


if __name__ == "__main__":
    main()
