"""A prototype for the MQA B=1 decode gap of issue 9 (session 35): a split-KV partial kernel
whose warps each keep their own softmax state over their own keys, merged once per program.

Why: a long MQA B=1 step's partial kernels alone read 17% (32k keys) to 9% (128k) slower than a
plain read of the same bytes (docs/benchmarks.md, session 35). ncu: the shipped kernel's one
4-warp program per SM issues an instruction every 8.4 cycles, a third of that waiting on
memory; its loop body holds seven CTA barriers per key step -- the row max and row sum of the
[16, 64] score tile are reduced across the 4 warps (which split its keys) through shared memory,
and P goes through shared memory to the PV dot. Deeper rings and more programs per SM were each
slower. Here the key step is [W, KB] keys as a batch of W 3-D dots, the batch over the warps:
every reduction of a step stays inside a warp, and the W states meet once, after the loop.

    TRITON_INTERPRET=1 python3 bench/warp_split_probe.py --device cpu   # float64 check, smoke run
    python3 bench/warp_split_probe.py --out ws.jsonl         # GPU: 16-layer graph steps, MQA B=1

The GPU mode times, per cell, the shipped plan (plain launch, and as dispatched: early start)
and the prototype at several (warps, keys per warp, stages), each checked against the shipped
output first, with and without the combine (`+nocomb`: the partial kernels alone).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from probe_rows import Rows, time_steps  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _ws_partial(Q, K, V, O, LSE, sm_scale, seqlen, num_splits, stride_qh, stride_kn, stride_vn,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, W: tl.constexpr, KB: tl.constexpr,
                D: tl.constexpr, PER_WARP: tl.constexpr, USE_PDL: tl.constexpr,
                REG_PREFETCH: tl.constexpr):
    # MQA, one sequence, one query token: the tile's rows are the GROUP q heads (padded to
    # BLOCK_M); K and V (N, D) of the one kv head. Split s covers keys [s * chunk, ...), chunk a
    # multiple of the step (W x KB keys, read as [W, KB, D]: warp w's KB keys). Writes O (rows,
    # splits, D) normalised by its own sum and LSE (rows, splits), natural log, as
    # attn_splitkv_partial does, so the shipped combine merges them. PER_WARP: each warp's state
    # is a split of its own (split * W + w of num_splits * W), left to the combine -- the merge
    # below converts the [W, 16, D] accumulator's layout through shared memory twice, 16 rounds
    # and 32 barriers each (sm_90 PTX), once a program.
    split = tl.program_id(0)
    chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), W * KB) * (W * KB)
    lo = tl.minimum(split * chunk, seqlen)
    hi = tl.minimum(lo + chunk, seqlen)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * stride_qh + offs_d[None, :], mask=rows[:, None] < GROUP,
                other=0.0)
    q3 = tl.broadcast_to(q[None, :, :], (W, BLOCK_M, D))
    qk_scale = sm_scale * 1.4426950408889634
    m = tl.full((W, BLOCK_M), float("-inf"), tl.float32)
    den = tl.zeros((W, BLOCK_M), tl.float32)
    acc = tl.zeros((W, BLOCK_M, D), tl.float32)
    keys = tl.arange(0, W)[:, None] * KB + tl.arange(0, KB)[None, :]  # [W, KB]
    if REG_PREFETCH:  # the next step's K and V are loaded into registers before this step's
        # math (num_stages=1: no shared-memory ring), as a plain streaming read keeps its bytes
        # in flight
        ok_n = (lo + keys) < hi
        k_n = tl.load(K + (lo + keys)[:, :, None] * stride_kn + offs_d[None, None, :],
                      mask=ok_n[:, :, None], other=0.0)
        v_n = tl.load(V + (lo + keys)[:, :, None] * stride_vn + offs_d[None, None, :],
                      mask=ok_n[:, :, None], other=0.0)
    for start in tl.range(lo, hi, W * KB):
        cols = start + keys
        ok = cols < hi
        if REG_PREFETCH:
            k = k_n
            v = v_n
            nxt = cols + W * KB
            ok_n = nxt < hi
            k_n = tl.load(K + nxt[:, :, None] * stride_kn + offs_d[None, None, :],
                          mask=ok_n[:, :, None], other=0.0)
            v_n = tl.load(V + nxt[:, :, None] * stride_vn + offs_d[None, None, :],
                          mask=ok_n[:, :, None], other=0.0)
        else:
            k = tl.load(K + cols[:, :, None] * stride_kn + offs_d[None, None, :],
                        mask=ok[:, :, None], other=0.0)
            v = tl.load(V + cols[:, :, None] * stride_vn + offs_d[None, None, :],
                        mask=ok[:, :, None], other=0.0)
        qk = tl.dot(q3, tl.permute(k, (0, 2, 1)))  # [W, BLOCK_M, KB], float32
        qk = tl.where(ok[:, None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 2) * qk_scale)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp with no keys yet: no NaN
        p = tl.math.exp2(qk * qk_scale - m_sub[:, :, None])
        alpha = tl.math.exp2(m - m_sub)
        den = den * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None]
        acc = tl.dot(p.to(v.dtype), v, acc)  # [W, BLOCK_M, D]
        m = m_new
    row_ok = rows < GROUP
    if PER_WARP:
        seen_w = den > 0.0
        den_w = tl.where(seen_w, den, 1.0)
        m_w = tl.where(m == float("-inf"), 0.0, m)
        lse_w = tl.where(seen_w, (m_w + tl.math.log2(den_w)) * 0.6931471805599453, float("-inf"))
        col = split * W + tl.arange(0, W)  # [W]
        tl.store(LSE + rows[None, :] * (num_splits * W) + col[:, None], lse_w,
                 mask=row_ok[None, :])
        tl.store(O + ((rows[None, :, None] * (num_splits * W) + col[:, None, None]) * D
                      + offs_d[None, None, :]), acc / den_w[:, :, None],
                 mask=row_ok[None, :, None])
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        return
    # the W warps' states, merged once
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    sc = tl.math.exp2(m - m_safe[None, :])  # a warp that saw no key weighs 0
    den_all = tl.sum(den * sc, 0)
    o = tl.sum(acc * sc[:, :, None], 0)
    seen = den_all > 0.0
    den_safe = tl.where(seen, den_all, 1.0)
    o = o / den_safe[:, None]
    lse = tl.where(seen, (m_safe + tl.math.log2(den_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + rows * num_splits + split, lse, mask=row_ok)
    tl.store(O + (rows[:, None] * num_splits + split) * D + offs_d[None, :], o,
             mask=row_ok[:, None])
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the combine may start once every program is here


class WarpSplit:
    """The prototype's launch for q (1, 1, G, D), caches (1, N, 1, D): run(q, k, v, n) -> O, LSE
    (as SplitKVPlan.run), the combine the shipped one (USE_PDL as shipped: a dependent launch)."""

    def __init__(self, q, k, warps: int, kb: int, stages: int, splits: int, pdl: bool,
                 combine: bool = True, per_warp: bool = False, reg_prefetch: bool = False,
                 num_warps: int = 0):
        from flashtune.codegen import Variant, load
        from flashtune.launch_splitkv import combine_tile
        self.g, self.d = q.shape[2], q.shape[3]
        self.warps, self.kb, self.stages, self.splits = warps, kb, stages, splits
        self.pdl, self.combine, self.per_warp = pdl, combine, per_warp
        self.reg_prefetch, self.num_warps = reg_prefetch, num_warps or warps
        self.block_m = max(16, triton.next_power_of_2(self.g))
        self.mod = load(Variant("splitkv", block_m=64, block_n=64, num_warps=4, num_stages=3))
        self.parts = splits * (warps if per_warp else 1)  # what the combine merges
        self.block_s, self.chunk_d = combine_tile(self.parts, self.d)
        self.name = (f"warp-split w{warps} kb{kb} s{stages} sp{splits}"
                     + (f" nw{num_warps}" if num_warps else "")
                     + (" regpf" if reg_prefetch else "") + (" per-warp" if per_warp else ""))

    def run(self, q, k, v, n: int):
        g, d, s, parts = self.g, self.d, self.splits, self.parts
        o_part = torch.empty((g, parts, d), dtype=torch.float32, device=q.device)
        l_part = torch.empty((g, parts), dtype=torch.float32, device=q.device)
        _ws_partial[(s,)](q, k, v, o_part, l_part, 1.0 / d ** 0.5, n, s, q.stride(2),
                          k.stride(1), v.stride(1), GROUP=g, BLOCK_M=self.block_m,
                          W=self.warps, KB=self.kb, D=d, PER_WARP=self.per_warp,
                          USE_PDL=self.pdl, REG_PREFETCH=self.reg_prefetch,
                          num_warps=self.num_warps, num_stages=self.stages)
        return combined(self, q, o_part, l_part, parts)


def shipped_runs(q, kcs, vcs, seqlens, nk: int) -> tuple:
    """(the dispatched variant, {label: run(i)}): its plan launched plainly, as dispatched (the
    early start), and its partial kernels alone, over layer i's caches."""
    from flashtune import kvcache
    from flashtune.launch_splitkv import SplitKVPlan
    var = kvcache._variant(q, kcs[0], vcs[0], False, False, nk)
    runs = {}
    for label, early, comb in (("shipped plain", False, True), ("shipped early", True, True),
                               ("shipped plain+nocomb", False, False)):
        plan = SplitKVPlan(q, kcs[0], False, None, var)
        plan.allow_early, plan.skip_combine = early, not comb
        runs[f"{var.name} {label}"] = (lambda p: lambda i: p.run(q, kcs[i], vcs[i], seqlens,
                                                                  None, nk))(plan)
    return var, runs


def combined(proto, q, o_part, l_part, parts: int, early: bool = False):
    """(O, LSE) of a prototype's partial outputs (G, parts, D) / (G, parts) for q (1, 1, G, D),
    merged by the shipped combine of proto.mod (proto.combine False: left unmerged, the partial
    kernels alone timed); early: the early_start render's combine (it lets the next kernel in
    after its own wait)."""
    g, d = q.shape[2], q.shape[3]
    o = torch.empty_like(q)
    lse = torch.empty((1, g, 1), dtype=torch.float32, device=q.device)
    if proto.combine:
        extra = {"launch_pdl": True} if proto.pdl else {}
        if early:
            extra["TRIGGER_FIRST"] = False
        proto.mod.attn_splitkv_combine[(g, triton.cdiv(d, proto.chunk_d))](
            o_part, l_part, o, lse, g, 1, parts, o.stride(0), o.stride(1), o.stride(2),
            HEAD_DIM=d, BLOCK_S=proto.block_s, CHUNK_D=proto.chunk_d, USE_PDL=proto.pdl,
            num_warps=4, **extra)
    return o, lse


# G, N, W, KB, splits, per_warp
CPU_CASES = ((8, 200, 4, 16, 3, False), (8, 64, 2, 16, 8, False), (4, 1000, 4, 16, 5, False),
             (8, 200, 4, 16, 3, True), (8, 64, 2, 16, 8, True), (8, 200, 4, 16, 3, False, True),
             (8, 64, 1, 32, 8, False, True), (4, 1000, 2, 16, 5, True, True))


def check_case(g: int, n: int, warps: int, kb: int, splits: int, per_warp: bool,
               reg_prefetch: bool = False) -> tuple:
    """(max |O - ref|, max |LSE - ref|) of the prototype in the interpreter (float16: bfloat16
    dots are wrong there) against float64, the cache longer than the sequence; N=64 with 8
    splits of 32-key steps leaves six splits without keys."""
    from flashtune.reference import reference
    q = torch.randn(1, 1, g, 64, dtype=torch.float16)
    k = torch.randn(1, n + 37, 1, 64, dtype=torch.float16)  # capacity past the length
    v = torch.randn_like(k)
    o, lse = WarpSplit(q, k, warps, kb, 1, splits, pdl=False, per_warp=per_warp,
                       reg_prefetch=reg_prefetch).run(q, k, v, n)
    kk, vv = (t[:, :n].transpose(1, 2).double().expand(1, g, n, 64) for t in (k, v))
    err = (o.transpose(1, 2).double() - reference(q.transpose(1, 2).double(), kk, vv))
    lse_ref = torch.logsumexp(q[0, 0].double() @ k[0, :n, 0].double().T / 8.0, -1)
    return err.abs().max().item(), (lse[0, :, 0].double() - lse_ref).abs().max().item()


def cpu_check() -> None:
    torch.manual_seed(0)
    for case in CPU_CASES:
        err, lse_err = check_case(*case)
        print("G={} N={} W={} KB={} splits={} per_warp={} reg_prefetch={}:".format(
                  *case, *(() if len(case) > 6 else (False,))),
              f"max |O - ref| {err:.2e}, max |LSE - ref| {lse_err:.2e}")
        assert err < 2e-3 and lse_err < 2e-3, (err, lse_err)
    print("ok")


def gpu(out: str, cells, configs, reps: int, device: str = "cuda") -> None:
    """device "cpu": a smoke run of this function in the interpreter (2 layers, float16, no
    graphs, 4 splits), so a device call does not find its bugs."""
    import decode_bench as db
    cuda = device == "cuda"
    db.GRAPH, db.DEVICE = cuda, device
    layers, d = (16, 128) if cuda else (2, 64)
    dt = torch.bfloat16 if cuda else torch.float16
    write = Rows(out, device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    for nk in cells:
        q = torch.randn(1, 1, 8, d, dtype=dt, device=device)
        kcs = [torch.randn(1, nk, 1, d, dtype=dt, device=device) for _ in range(layers)]
        vcs = [torch.randn_like(k) for k in kcs]
        sl = torch.full((1,), nk, dtype=torch.int32, device=device)
        kv_bytes = 2 * nk * d * 2
        var, runs = shipped_runs(q, kcs, vcs, sl, nk)
        for warps, kb, stages, flags in configs:
            for comb in (True, False):
                ws = WarpSplit(q, kcs[0], warps, kb, stages, sms * flags["x"], pdl=cuda,
                               combine=comb, per_warp=flags["w"], reg_prefetch=flags["r"],
                               num_warps=flags["n"])
                runs[ws.name + ("" if comb else "+nocomb")] = (
                    lambda w: lambda i: w.run(q, kcs[i], vcs[i], nk))(ws)
        ref = runs[f"{var.name} shipped plain"](0)[0]
        times = {}
        for label, run in runs.items():
            try:
                got = run(0)[0]
                if cuda:
                    torch.cuda.synchronize()
                diff = (got.float() - ref.float()).abs().max().item()
                write({"Nk": nk, "impl": label, "max_diff_vs_shipped": diff})
                if "nocomb" in label or diff < 2e-2:
                    times[label] = []
            except Exception as e:  # noqa: BLE001 -- a config that cannot build is a row
                write({"Nk": nk, "impl": label, "error": f"{type(e).__name__}: {e}"[:300]})
        time_steps(write, {label: (lambda r: lambda i: lambda: r(i))(runs[label])
                           for label in times}, layers, reps, kv_bytes, {"Nk": nk})
        q = kcs = vcs = runs = ref = None
        if cuda:
            torch.cuda.empty_cache()
    write.close()


def parse_config(text: str) -> tuple:
    """(W, KB, stages, flags) of one --configs entry."""
    w, kb, stages, *rest = text.split("/")
    flags = {"w": "w" in rest, "r": "r" in rest, "x": 1, "n": 0}
    for x in rest:
        if x[:1] in "xn" and x[1:].isdigit():
            flags[x[0]] = int(x[1:])
        elif x not in ("w", "r"):
            raise SystemExit(f"--configs: {text!r}: {x!r} is not w, r, xN or nN")
    return int(w), int(kb), int(stages), flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="warp_split.jsonl")
    ap.add_argument("--cells", default="32768,131072", help="key counts (MQA 8/1, B=1, D=128)")
    ap.add_argument("--configs", default="4/16/3,4/16/3/w,4/16/4,2/32/3,2/32/3/w,8/16/3",
                    help="W/keys-per-warp/stages[/w][/r][/xN][/nN],... (W: the step's batch "
                         "of warps; w: each warp's state a split of its own, merged by the "
                         "combine; r: the next step's K/V loaded into registers before this "
                         "step's math; xN: N programs a SM; nN: N warps, not W)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    configs = [parse_config(x) for x in a.configs.split(",")]
    if a.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernel is decorated
            raise SystemExit("--device cpu: run with TRITON_INTERPRET=1")
        cpu_check()
        gpu(a.out, [300], configs, 1, "cpu")  # the GPU mode's own code, small
        return
    gpu(a.out, [int(x) for x in a.cells.split(",")], configs, a.reps)


if __name__ == "__main__":
    main()
