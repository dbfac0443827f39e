"""Launch the splitkv family (Flash-Decoding over a KV cache): the partial kernel over
(sequence, kv head, row tile) x splits, then the combine kernel. Grid, strides, constexprs and
the launch-time num_splits rule; which variant runs is decided by the caller (kvcache.py)."""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import torch
import triton

from . import alloc
from .codegen import Variant, load
from .launcher import Launcher
from .launch import _DOT_PRECISION, _need_allocator, block_d, pdl_ok

# Provisional defaults until measured (no GPU measurement chose them yet; the split count is
# decided at launch, see auto_num_splits). Keyed by the largest head dim each serves.
DEFAULTS = {
    64: Variant("splitkv", block_m=64, block_n=128, num_warps=4, num_stages=3),
    128: Variant("splitkv", block_m=64, block_n=64, num_warps=4, num_stages=3),
    256: Variant("splitkv", block_m=64, block_n=32, num_warps=4, num_stages=2),
}

# early_start: the K/V bytes one launch sends to L2 before its wait, all programs together, and
# when its combine lets the next kernel launch. On the H100 (bench/decode_probe.py --parts early,
# 16-layer steps, docs/benchmarks.md sessions 34-35): with the combine letting the next partial
# kernel in after its own wait, 2 MiB was best or within 5% of it at every one-wave shape (0
# and 8 MiB, and half the L2, beside it). Letting it in before the wait (the next layer's programs
# start, and prefetch, while this layer's still stream) paid with 4 MiB where a layer's K/V are
# small beside the L2, so the prefetched lines survive the layer before: MQA B=1 2k paged 226 ->
# 230 GB/s, GQA B=1 2k (8.4 MB) 993 -> 1,021, paged 1,015 -> 1,068, MQA 8k +2-4%. It lost 2-3%
# at GQA 32k (134 MB) and MQA 128k (67 MB), about the bytes prefetched and evicted unread, and
# 4% at MQA 32k (16.8 MB, a third of the L2; the decode grid, session 35's call 4, where the
# probe read +3%: not resolved), hence a quarter of the L2 (first_trigger).
PREFETCH_BYTES = 2 << 20
PREFETCH_BYTES_FIRST = 4 << 20
# The gluon render's early start where its ring holds an SM alone (ring_alone: n128-s2, n64-s4
# at D=128): one tile loaded before its wait (PRELOAD), its combine letting the next kernel in
# before its own wait, and 2 MiB (not 4) sent to L2, so the next layer's programs take each SM
# as this layer's leave it and load while this layer's last programs, its combine and the
# handoffs run. H100, MQA B=1, 16-layer steps (bench/splitkv_timeline.py, docs/benchmarks.md
# session 38, calls 5-7): n128-s2 so, 32k 1,676 -> 1,785 GB/s, 64k 2,124 -> 2,352, 128k
# 2,451 -> 2,571 against the n64-s2 record; two tiles were slower (the combine's reads wait
# behind them: 1.2 -> 2.1-5.5 us), 4 MiB to L2 -1.5% at 32k, +0.3% at 128k; rings that two
# programs share an SM with lose (the next layer's loads start beside this layer's first:
# n64-s2 GQA B=1 2k 1,152 -> 985).
PRELOAD_TILES = 1
# ... issued one K or V half at a time (PRELOAD_PACE in flight), each after the one before it
# landed: all at once, the next layer's preloads queued 8-17 MB before the combine's reads (its
# work 1.2 -> 2.2-5 us); paced, it stays at 1.7-1.9 us while DRAM keeps streaming. So paced, a
# split whose share is longer than its ring preloads the whole ring. H100, 16-layer steps
# (bench/gluon_splitkv.py, docs/benchmarks.md session 40, calls 1-2), n128-s2, GB/s, against one
# tile all at once: MQA B=1 32k (1.9 tiles a split) one tile paced 1,790 -> 2,000-2,007, the
# ring paced 1,714 (three round trips before it waits); 64k (3.9) 2,352 -> 2,531-2,536 (one
# tile paced 2,459-2,468); 128k 2,650 -> 2,773-2,778; GQA B=1 8k (4) 2,148 -> 2,465; two halves
# in flight, or 64-key halves, were slower everywhere
PRELOAD_PACE = 1
# ... and, where a split's share of the longest sequence is at least STEAL_MIN_TILES tiles, its
# splits share the tiles past their own (STEAL_OWN each; a counter per (sequence, kv head)
# hands them out one at a time), so an SM that streams faster takes more of them: with fixed
# shares some two dozen SMs ended their 8 tiles 4-5 us before the rest, every layer (the same
# SMs; bench/splitkv_timeline.py). H100, 16-layer steps (docs/benchmarks.md session 39, calls
# 1-5, owning 2), MQA B=1: 128k (7.8 tiles a split) 2,566-2,571 -> 2,620-2,642 GB/s; 64k (3.9)
# 2,341 -> 2,248, 32k (1.9) 1,784 -> 1,738; GQA B=1 8k (4) 2,142 -> 2,007, 32k (16) 2,752 ->
# 2,809.
# Paged: session 39 measured no gain (shuffled 256-key pages, a ticket's page read as it is
# drawn, or a step ahead: MQA B=1 128k 2,572 -> 2,562-2,573, 64k 2,303 -> 2,269, calls 6-7), with
# the tickets of then (a split owning only its ring). Session 42's stamps (bench/splitkv_timeline
# --page, call 5) showed fixed shares' tail again: MQA B=1 128k, median program's end -> last
# exit 2.52 us paged against 1.34 stealing contiguous. Now a paged split asks its tickets three
# steps ahead and reads each page two steps ahead (the template's header): fixed shares ->
# STEAL, paged, H100 (session 42, call 6): MQA B=1 128k 2,661 -> 2,684 GB/s, MQA B=8 128k 2,951
# -> 3,007, GQA B=1 32k 2,855 -> 2,890 (contiguous stealing 2,772 / 3,096 / 2,926, same run)
STEAL_PAGED = True
STEAL_TILES = True
STEAL_MIN_TILES = 6
# A split owns its first STEAL_OWN tiles (t_step apart; at least its ring's stages) and takes
# tickets past them: tickets cost (an atomic's round trip a step, behind the stream's loads),
# the fewer a split takes the better, while some two tiles each are left to balance. H100, MQA
# B=1 (calls 8-9, 16-layer steps): 128k owning 2 / 3 / 4 / 6: 2,609-2,634 / 2,631-2,651 /
# 2,622-2,653 / 2,614 GB/s (fixed shares 2,577); GQA B=1 32k (16 tiles a split) 2,804 / 2,812 /
# 2,813 (fixed 2,759)
STEAL_OWN = 4
SM90_SMEM = 233472  # shared memory of an sm_90 SM; a block reserves 1 KiB of it
MIN_BLOCKS_PER_SPLIT = 1   # a split streams at least this many BLOCK_N blocks (see auto_num_splits)
MAX_SPLITS = 256
CPU_SMS = 4                # the interpreter has no SMs: auto picks as if there were 4
COMBINE_TILE = 4096        # float32 elements of O one combine program loads (splits x D slice)


# float32 (a test dtype) computes in float64: the tiles above spill there (D=64 60-104 B, D=128
# 32-36 B on sm_80/sm_90, `kernels check`, triton 3.9, 2026-11-23); m16-n32-w4-s2 does not
# (127-222 registers, 0 B). D=256 float32 is not compile-checked (as for fwd/bwd: see defaults.py).
DEFAULTS_F32 = {
    64: Variant("splitkv", block_m=16, block_n=32, num_warps=4, num_stages=2),
    128: Variant("splitkv", block_m=16, block_n=32, num_warps=4, num_stages=2),
    256: Variant("splitkv", block_m=16, block_n=16, num_warps=4, num_stages=1),
}


def early_consts(block_d_: int, elsize: int) -> dict:
    """The early_start render's partial-kernel constexprs: PF_LINE, the elements of one 128-byte
    line (one prefetch each)."""
    return {"PF_LINE": min(block_d_, 128 // elsize)}


def default_variant(head_dim: int, dtype: str = "bfloat16") -> Variant:
    """The built-in splitkv variant for a head dim and dtype name (the same on every arch:
    pointer loads, spill-free on sm_80 and sm_90)."""
    table = DEFAULTS_F32 if dtype == "float32" else DEFAULTS
    for d in sorted(table):
        if head_dim <= d:
            return table[d]
    return table[max(table)]


@lru_cache(maxsize=None)
def _props(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _device_props(device: torch.device):
    return _props(device.index if device.index is not None else torch.cuda.current_device())


def l2_bytes(device: torch.device) -> int:
    """The device's L2 in bytes (0 off a GPU)."""
    return _device_props(device).L2_cache_size if device.type == "cuda" else 0


def sm_count(device: torch.device) -> int:
    return _device_props(device).multi_processor_count if device.type == "cuda" else CPU_SMS


def auto_num_splits(programs: int, max_seqlen: int, block_n: int, sms: int) -> int:
    """num_splits=0: about one wave of the GPU's SMs (round(sms / programs)), each split streaming
    at least MIN_BLOCKS_PER_SPLIT key blocks, at most MAX_SPLITS.
      programs: partial-kernel programs per split (batch * kv_heads * row tiles).
    Measured on the H100 (bench/decode_sweep.py, docs/data/decode_sweep_h100_2026-11-23.jsonl):
    one wave was best or within 2% of the best split count at every shape swept; two waves lost
    1-10% (B=1 GQA 32/8: 16 splits 2106 GB/s, 33 splits 2081; B=32: 1 split 3101, 2 splits 3059).
    Short caches fill the wave down to one block per split: a split's blocks are a chain of
    memory round trips there (MQA B=1, 16-layer graph, docs/data/decode_h100_2026-11-23_run4_
    splits_layers16.jsonl: 4k keys 64 splits 285 GB/s, 16 splits (4 blocks each) 216, cuDNN
    245; 8k 128 splits 515, 32 splits 399, cuDNN 405).
    E.g. H100 (132 SMs), B=1, Hk=8 -> 16 splits; MQA B=1 -> 132 (or one per block below 8k keys);
    B=8, Hk=8 -> 2; B >= 32, Hk=8 -> 1 split (no combine)."""
    blocks = triton.cdiv(max(max_seqlen, 1), block_n)
    want = max(1, round(sms / max(programs, 1)))
    return max(1, min(want, blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


def clamp_num_splits(num_splits: int, max_seqlen: int, block_n: int) -> int:
    """An explicit num_splits, at most one split per key block of the longest sequence."""
    return max(1, min(num_splits, triton.cdiv(max(max_seqlen, 1), block_n)))


def row_block(variant: Variant, group: int, nq: int) -> int:
    """BLOCK_M: the tile's rows hold GROUP heads x Nq tokens, rounded up to a power of two
    >= 16 (tl.dot's minimum), at most the variant's block_m (more rows: more row tiles)."""
    return min(variant.block_m, max(16, triton.next_power_of_2(group * nq)))


def descriptor_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool) -> bool:
    """TMA needs 16-byte aligned bases and strides; the paged descriptor reads all pages of a kv
    head as one matrix, so the pages must follow each other (page stride = page_size rows)."""
    for t in (k_cache, v_cache):
        s = t.stride()
        if t.data_ptr() & 15 or ((s[0] | s[1] | s[2]) * t.element_size()) & 15:
            return False
        if paged and s[0] != t.shape[1] * s[1]:
            return False
    return True


def gluon_blocker(q, k_cache, variant: Variant) -> str:
    """Why the gluon render cannot serve q (B, Nq, Hq, D) over k_cache ("" when it can): an
    sm_90 GPU with Gluon (meta tensors pass: compile-ahead), bf16/fp16, D 64 or 128, the tile's
    GROUP x Nq rows within its block_m (one tile per (sequence, kv head)), a contiguous cache
    (the TMA view is (B * Ncache, Hk * D); paged, (num_pages * page size, Hk * D): the pages one
    block of memory)."""
    b, nq, h, d = q.shape
    hk = k_cache.shape[2]
    if q.device.type == "cuda":
        if torch.cuda.get_device_capability(q.device) != (9, 0):
            return "not an sm_90 GPU"
        from .gluon_compat import missing
        why = missing()
        if why:
            return why
    elif q.device.type != "meta":
        return "tensors are not on a GPU"
    if q.dtype not in (torch.bfloat16, torch.float16) or d not in (64, 128):
        return "bf16/fp16 with head dim 64 or 128 only"
    if (h // hk) * nq > variant.block_m:
        return f"GROUP x Nq = {(h // hk) * nq} rows, more than one {variant.block_m}-row tile"
    if not _contiguous(k_cache):
        return "a cache that is not contiguous"
    return ""


def _contiguous(t) -> bool:
    n, hk, d = t.shape[1:]
    return t.stride() == (n * hk * d, hk * d, d, 1)


@lru_cache(maxsize=None)
def _gluon_layout(block_n: int, head_dim: int, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdt)


def gluon_rows(plan) -> dict:
    """The gluon render's ROWS constexpr where its tile's rows are wgmma's N (block_m 16/32,
    swap_ab: the plan's row_block); its 64-row tile takes none."""
    return {"ROWS": plan.block_m} if plan.variant.structure()["swap_ab"] else {}


class GluonPartial:
    """The gluon render's partial launch, called as the Triton kernel's launcher is (run's
    arguments) and mapping them onto the Gluon kernel's: K and V as TMA descriptors over the
    (B * Ncache, Hk * D) view, paged (num_pages * page size, Hk * D), made per call (Gluon's
    checks once per shape: launcher.gluon_desc). Caches a descriptor cannot address (a base or
    stride off 16 bytes, V laid out unlike K) go to the Triton render's partial kernel, which
    takes the same grid and arguments."""
    __slots__ = ("plan", "launch", "uniform", "early", "steal", "fallback")

    def __init__(self, plan, kernel, uniform: bool, early: bool, steal: bool, pre: int):
        # steal: the early render's splits share their tiles; pre: the tiles it loads before
        # its wait (run decides both: steals, preload_tiles)
        self.plan, self.uniform, self.early, self.steal = plan, uniform, early, steal
        extra = {"launch_pdl": True} if early and plan.pdl else {}
        if early:
            extra["PRELOAD"] = pre
            extra["PACE"] = plan.preload_pace()
            extra["STEAL"] = self.steal
        if plan.paged:
            extra["PAGE"] = plan.kwargs["PAGE"]
        extra.update(gluon_rows(plan))
        self.launch = Launcher(kernel, GROUP=plan.kwargs["GROUP"],
                               STAGES=plan.variant.num_stages,
                               IS_CAUSAL=plan.kwargs["IS_CAUSAL"], UNIFORM=uniform, num_warps=4,
                               **extra)
        self.fallback = None

    def __call__(self, grid, q, k, v, bt, seqlens, o, lse, scale, sqb, sqm, sqh, skb, skn, skh,
                 svb, svn, svh, sbt, sob, som, soh, sos, slb, slm, slh, sls, hk, nq, s,
                 num_pages, max_keys, *early_args, fresh: int = 1):
        """fresh: the keys at the end of each sequence the kernel before may still be writing
        (the early start never keeps a tile of them loaded before its wait)."""
        if v.stride() != k.stride() or not _contiguous(k) or not descriptor_ok(k, v, False):
            if self.fallback is None:
                self.fallback = self.plan._triton_partial(self.uniform, self.early)
            return self.fallback(grid, q, k, v, bt, seqlens, o, lse, scale, sqb, sqm, sqh, skb,
                                 skn, skh, svb, svn, svh, sbt, sob, som, soh, sos, slb, slm,
                                 slh, sls, hk, nq, s, num_pages, max_keys, *early_args)
        from .launcher import gluon_desc
        n, d = k.shape[1], k.shape[3]  # paged: n is the page size
        bn = self.plan.variant.block_n
        lay = _gluon_layout(bn, d, k.dtype)
        kd, vd = (gluon_desc(t, [t.shape[0] * n, hk * d], [hk * d, 1], [bn, d], lay)
                  for t in (k, v))
        paged = ()
        if self.plan.paged:  # run passes the splits' placement before the early arguments
            paged, early_args = (bt, sbt, num_pages, *early_args[:2]), early_args[2:]
        hint, rows, trigger = early_args if self.early else (0, 0, 0)
        tail = ()
        if self.early:  # CNT: the STEAL counters (unread without STEAL: any pointer will do)
            tail = (fresh, self.plan.counters(q.device) if self.steal else o,
                    self.plan.steal_rounds())
        # uniform: SEQLENS is never read (any pointer will do)
        self.launch(grid, q, k, v, kd, vd, seqlens if seqlens is not None else o, o, lse, scale,
                    *paged, sqb, sqm, sqh, skb, skn, skh, sob, som, soh, sos, slb, slm, slh, sls,
                    hk, nq, s, n, max_keys, hint, rows, trigger, *tail)


class SplitKVPlan:
    """One splitkv launch shape: q (B, Nq, Hq, D); caches (B, Ncache, Hk, D) or, paged,
    (num_pages, page_size, Hk, D) with block_table (B, max_pages) int32. Everything that depends
    only on shapes, strides, dtype and the variant is fixed here (callers memoize plans); the
    split count follows each call's longest sequence (run's max_seqlen)."""

    def __init__(self, q, k_cache, causal: bool, scale: float | None, variant: Variant,
                 masks=None):
        from .launch import check_mask_variant, mask_args, mask_params
        from .masks import NONE
        masks = masks or NONE
        check_mask_variant(variant, masks)
        b, nq, h, d = q.shape
        hk = k_cache.shape[2]
        group = h // hk
        why = block_mask_blocker(masks.block_mask, nq, group, variant.paged)
        if why:
            raise ValueError(f"{variant.name}: {why}")
        # window / softcap / block mask runtime arguments after sm_scale (launch.mask_args)
        self.mask_args = mask_args(masks, causal, "q", b, h)
        # the gluon render where it can run; else the same variant without it (why: gluon_why)
        self.gluon_why = gluon_blocker(q, k_cache, variant) if variant.gluon else ""
        if self.gluon_why:
            variant = dataclasses.replace(variant, gluon=False)
        self.variant = variant
        self.paged = variant.paged
        self._mods = {variant.early_start: load(variant)}
        self.block_m = row_block(variant, group, nq)
        num_m = -(-(group * nq) // self.block_m)
        self.programs = b * hk * num_m
        self.sms = sm_count(q.device)
        self.shape = (b, nq, h, d)
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        # the combine starts while the partial kernel's last programs finish (its launch latency
        # was a visible part of a batch-1 decode step)
        self.pdl = pdl_ok(q.device)
        # early_start's render where PDL works and the grid is one wave (run); the probe's
        # baseline turns it off, and sets other prefetch budgets
        self.allow_early = True
        # early_start's prefetch budget and whether its combine lets the next kernel launch
        # before its own wait (None: the rules in _early_args, first_trigger); the probe sets them
        self.prefetch_bytes: int | None = None
        self.trigger_first: bool | None = None
        # the tiles of its ring the gluon render's early start loads before its wait (None: the
        # rule in preload_tiles); the probe sets it
        self.preload: int | None = None
        # at most this many of those K / V halves in flight before the wait (None: PRELOAD_PACE;
        # 0: all at once); the probe sets it
        self.pace: int | None = None
        # whether the gluon render's early start shares tiles between its splits (None: the rule
        # in steals); the probe sets it. Its counters: one per (sequence, kv head) and CUDA stream
        self.steal: bool | None = None
        # the tiles a stealing split owns (None: STEAL_OWN); the probe sets it
        self.steal_own: int | None = None
        # whether the gluon render's early start lets the combine launch at its programs' start
        # (before their loads and wait) rather than after the wait (None: after); the probe sets it
        self.trigger_start: bool | None = None
        self._counters: dict = {}
        self.skip_combine = False  # the probe's partial kernels alone (their outputs unmerged)
        self.elsize = k_cache.element_size()
        self.step_bytes_per_key = 2 * b * hk * d * self.elsize  # K and V of one key position
        self.l2_bytes = l2_bytes(q.device)
        self.kwargs = dict(
            HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=self.block_m, BLOCK_N=variant.block_n,
            IS_CAUSAL=causal, GROUP=group, PAGE=k_cache.shape[1] if self.paged else 0,
            DOT_PRECISION=_DOT_PRECISION.get(q.dtype, "tf32"), PRECISE=q.dtype == torch.float32,
            USE_PDL=self.pdl, num_warps=variant.num_warps,
            num_stages=variant.num_stages, **mask_params(masks))
        # decided once, not per call: first_trigger and _early_args read it on every run
        self.ring_alone = self._ring_alone()
        self._splits: dict = {}
        # launchers (launcher.Launcher), made at the first run that needs them (kwargs may be
        # changed before: bench/decode_sweep.py turns PDL off): the partial kernel's per
        # UNIFORM, the combine's per split count
        self._launchers: dict = {}

    def _module(self, early: bool):
        mod = self._mods.get(early)
        if mod is None:
            mod = self._mods[early] = load(dataclasses.replace(self.variant, early_start=early))
        return mod

    def _launcher(self, key):
        """key: ("partial", UNIFORM, early, steal, pre) or ("combine", num_splits, early,
        first); early: the early_start render (its combine lets the next kernel start: before
        its wait where first); steal: its splits share their tiles (steals); pre: the gluon
        render's tiles loaded before its wait (preload_tiles)."""
        got = self._launchers.get(key)
        if got is None:
            if len(self._launchers) > 64:
                self._launchers.clear()
            mod = self._module(key[2])
            if key[0] == "partial" and self.variant.gluon:
                got = GluonPartial(self, mod.attn_splitkv_partial, *key[1:])
            elif key[0] == "partial":
                got = self._triton_partial(key[1], key[2], mod)
            else:
                block_s, chunk_d = combine_tile(key[1], self.kwargs["BLOCK_D"])
                extra = {"TRIGGER_FIRST": key[3]} if key[2] else {}
                if self.pdl:
                    extra["launch_pdl"] = True
                got = Launcher(mod.attn_splitkv_combine, HEAD_DIM=self.shape[3],
                               BLOCK_S=block_s, CHUNK_D=chunk_d, USE_PDL=self.pdl, num_warps=4,
                               **extra)
            self._launchers[key] = got
        return got

    def _triton_partial(self, uniform: bool, early: bool, mod=None):
        """The Triton render's partial-kernel launcher (the gluon render's fallback: mod None
        loads this variant without gluon)."""
        if mod is None:
            mod = load(dataclasses.replace(self.variant, gluon=False, early_start=early))
        extra = {}
        if early:
            extra.update(early_consts(self.kwargs["BLOCK_D"], self.elsize))
            if self.pdl:
                extra["launch_pdl"] = True
        return Launcher(mod.attn_splitkv_partial, UNIFORM=uniform, **extra, **self.kwargs)

    def early(self, num_splits: int) -> bool:
        """Whether a launch of num_splits splits takes the early_start render: the variant asks
        for it, or PDL works and the grid is one wave (two waves: the next kernel's early
        programs would hold SMs this one's second wave needs -- GQA B=8 2k lost 8-11% so)."""
        return self.variant.early_start or (self.pdl and self.allow_early
                                            and self.programs * num_splits <= self.sms)

    def first_trigger(self, keys: int) -> bool:
        """Whether an early launch's combine lets the next kernel launch before its own wait: where
        the step's K/V (keys per sequence) take at most a quarter of the L2, so what the next
        layer's programs prefetch while this layer streams is still there when they read it
        (PREFETCH_BYTES' comment has the measurements)."""
        if self.trigger_first is not None:
            return self.trigger_first
        if self.ring_alone:  # PRELOAD_TILES' comment
            return True
        return 4 * keys * self.step_bytes_per_key <= self.l2_bytes

    def _ring_alone(self) -> bool:
        """Whether the gluon render's partial kernel holds its SM alone: two of its shared
        memory (the ring, Q) do not fit on one (fixed per plan: __init__ keeps it, ring_alone)."""
        if not self.variant.gluon:
            return False
        from .feasibility import splitkv_gluon_smem
        smem = splitkv_gluon_smem(self.variant, self.kwargs["BLOCK_D"], self.elsize)
        return 2 * (smem + 1024) > SM90_SMEM

    def preload_tiles(self, keys: int, num_splits: int) -> int:
        """The tiles of its ring the gluon render's early start loads before its wait, its
        splits placed by `keys` (the probe's `preload`, else, where the ring holds an SM alone,
        the whole ring where a split's share is longer, PRELOAD_TILES where it is not), at most
        its stages."""
        stages = self.variant.num_stages
        if self.preload is not None:
            pre = self.preload
        elif not self.ring_alone:
            pre = 0
        elif triton.cdiv(max(keys, 1), self.variant.block_n) > stages * num_splits:
            pre = stages
        else:
            pre = PRELOAD_TILES
        return max(0, min(int(pre), stages))

    def preload_pace(self) -> int:
        """The early start's preload: at most this many K / V halves in flight (0: no limit;
        the probe's `pace`, else PRELOAD_PACE)."""
        return max(0, int(PRELOAD_PACE if self.pace is None else self.pace))

    def steals(self, keys: int, num_splits: int) -> bool:
        """Whether the gluon render's early start shares the tiles past each split's own
        (steal_rounds) between its num_splits splits of sequences of at most `keys` keys (the
        probe's `steal`, else STEAL_TILES where the ring holds an SM alone and a split's share is
        at least STEAL_MIN_TILES tiles; paged, STEAL_PAGED too)."""
        if not self.variant.gluon:
            return False
        if self.steal is not None:
            return self.steal
        tiles = triton.cdiv(max(keys, 1), self.variant.block_n)
        return (STEAL_TILES and (STEAL_PAGED or not self.paged) and self.ring_alone
                and num_splits > 1 and tiles >= STEAL_MIN_TILES * num_splits)

    def steal_rounds(self) -> int:
        """STEAL's steal_own: the tiles a split owns (t_step apart) before the shared ones, at
        least its ring's stages, paged two more (its first two refills' pages are read beside
        its length: the template's header) (the probe's `steal_own`, else STEAL_OWN)."""
        own = STEAL_OWN if self.steal_own is None else self.steal_own
        return max(self.variant.num_stages + (2 if self.paged else 0), own)

    def counters(self, device) -> torch.Tensor:
        """The STEAL counters of this CUDA stream: (programs,) int32, 0 between launches (each
        launch's last ticket sets its counter back). Launches on one stream are ordered; two
        streams never share one. (A graph replays the counters of the stream it was captured on:
        two replays of graphs captured on one stream must not run at once.)"""
        key = (device.index, torch.cuda.current_stream(device).cuda_stream)
        got = self._counters.get(key)
        if got is None:
            got = self._counters[key] = torch.zeros(self.programs, dtype=torch.int32,
                                                    device=device)
        return got

    def _early_args(self, keys: int, num_splits: int, first: bool) -> tuple:
        """early_start's (hint_keys, prefetch_rows, early_trigger): the keys the splits are
        placed by before any length is read (the host's longest), the rows of K and of V each
        program sends to L2 (the budget over all programs), and whether the next kernel may
        start beside this one (one wave: every program of this one is already running)."""
        ctas = self.programs * num_splits
        budget = self.prefetch_bytes
        if budget is None:  # a ring alone on its SM: PRELOAD_TILES' comment
            budget = PREFETCH_BYTES_FIRST if first and not self.ring_alone else PREFETCH_BYTES
        rows = budget // max(1, ctas * 2 * self.shape[3] * self.elsize)
        trigger = int(ctas <= self.sms)
        if trigger and self.trigger_start and self.variant.gluon:
            trigger = 2  # the template's early_trigger 2
        return keys, rows, trigger

    def partial_key(self, uniform: bool, early: bool, keys: int, num_splits: int) -> tuple:
        """The partial kernel's launcher key (_launcher) for a launch of num_splits splits placed
        by `keys`: whether they share tiles (steals) and the tiles preloaded (preload_tiles)."""
        steal = early and self.steals(keys, num_splits)
        pre = self.preload_tiles(keys, num_splits) if early and self.variant.gluon else 0
        return ("partial", uniform, early, steal, pre)

    def num_splits(self, max_seqlen: int) -> int:
        s = self._splits.get(max_seqlen)
        if s is None:
            v = self.variant
            s = (auto_num_splits(self.programs, max_seqlen, v.block_n, self.sms)
                 if v.num_splits == 0 else clamp_num_splits(v.num_splits, max_seqlen, v.block_n))
            if len(self._splits) > 4096:
                self._splits.clear()
            self._splits[max_seqlen] = s
        return s

    def _split_args(self, split_keys: int, num_splits: int) -> tuple:
        """Paged: split_keys (the host's longest sequence, which places every split) and
        split_chunk, the keys of one split as the kernel would compute them from it."""
        block_n = self.kwargs["BLOCK_N"]
        return split_keys, triton.cdiv(triton.cdiv(split_keys, num_splits), block_n) * block_n

    def run(self, q, k_cache, v_cache, seqlens, block_table=None, max_seqlen: int = 0,
            appended: int = 0):
        """Returns O (q's shape, dtype and layout) and LSE (B, Hq, Nq) float32.
        seqlens (B,) int32 on q's device: the keys each sequence attends to (at most the cache's
        capacity, which the kernel clamps to); or None where every sequence holds max_seqlen
        keys (UNIFORM: no lengths tensor is read, made or kept). max_seqlen: a host int, their
        maximum; it sizes the splits. appended: the keys the call appended to each sequence just
        before (they, and at least the last Nq, are never read before the kernel's wait)."""
        b, nq, h, d = self.shape
        hk = k_cache.shape[2]
        s = self.num_splits(max_seqlen)
        o = alloc.empty_like(q)
        lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
        if s == 1:  # the partial kernel writes the result itself: no scratch, no combine
            o_dst, l_dst = o, lse
            o_strides = (*o.stride()[:3], 0)
            l_strides = (h * nq, 1, nq, 0)
        else:
            rows = b * h * nq
            o_dst = torch.empty((rows, s, d), dtype=torch.float32, device=q.device)
            l_dst = torch.empty((rows, s), dtype=torch.float32, device=q.device)
            o_strides = (h * nq * s * d, s * d, nq * s * d, d)
            l_strides = (h * nq * s, s, nq * s, 1)
        if self.variant.loads == "descriptor":
            _need_allocator()
        uniform = seqlens is None
        bt = block_table if self.paged else seqlens  # (unused when not paged)
        capacity = bt.shape[1] * k_cache.shape[1] if self.paged else k_cache.shape[1]
        early = self.early(s)
        keys = min(max_seqlen, capacity)
        first = early and self.first_trigger(keys)
        self._launcher(self.partial_key(uniform, early, keys, s))(
            (self.programs, s),
            q, k_cache, v_cache, bt, seqlens, o_dst, l_dst, self.scale, *self.mask_args,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            bt.stride(0) if bt is not None else 0,
            *o_strides, *l_strides,
            hk, nq, s, k_cache.shape[0] if self.paged else 0,
            keys if uniform else capacity,
            *(self._split_args(keys, s) if self.paged else ()),
            *(self._early_args(keys, s, first) if early else ()),
            **({"fresh": max(nq, appended)} if self.variant.gluon else {}))
        if s > 1 and not self.skip_combine:
            chunk_d = combine_tile(s, self.kwargs["BLOCK_D"])[1]
            self._launcher(("combine", s, early, first))(
                (b * h * nq, triton.cdiv(d, chunk_d)),
                o_dst, l_dst, o, lse, h, nq, s, o.stride(0), o.stride(1), o.stride(2))
        return o, lse


def combine_tile(num_splits: int, block_d: int) -> tuple:
    """The combine's tile: (BLOCK_S, CHUNK_D), BLOCK_S a power of two >= num_splits (all splits
    at once), CHUNK_D the slice of D one program merges, so the tile holds <= COMBINE_TILE
    elements (more splits: thinner slices, more programs)."""
    block_s = max(2, 1 << (num_splits - 1).bit_length())
    return block_s, max(16, min(block_d, COMBINE_TILE // block_s))


def block_mask_blocker(bm, nq: int, group: int, paged: bool) -> str:
    """Why the splitkv kernels cannot walk block mask `bm` for q (B, Nq, Hq, D) with GROUP q
    heads per kv head ("" when they can): a tile's rows (GROUP heads x Nq tokens) read one list
    row, so the tokens must lie in query block 0 and the heads share the mask."""
    if bm is None:
        return ""
    if paged:
        return "its paged renders take no block mask"
    if nq > bm.block_size[0]:
        return (f"a tile's {nq} query tokens span several query blocks of the block mask "
                f"(block_size {bm.block_size})")
    if group > 1 and bm.state.shape[1] > 1:
        return (f"the block mask differs per q head, and a tile packs the {group} q heads of a kv "
                "head")
    return ""


class DensePlan:
    """splitkv serving a dense forward call: q (B, H, Nq, D), k/v (B, Hk, Nk, D) in SDPA's
    layout, viewed (no copy) as the (B, N, H, D) cache layout the kernels take, every sequence
    holding all Nk keys (seqlens None, UNIFORM: no lengths tensor, so nothing is allocated or kept
    between calls -- a kept one broke torch.compile's CUDA graph trees). run(q, k, v) -> (O in q's
    layout, LSE (B, H, Nq)), as launch.FwdPlan. masks: the call's window / softcap / block mask; a
    block mask these kernels cannot walk (block_mask_blocker) runs the generic fwd's plan
    (`fallback`, `why`). any_seqlen_k: the plan serves a call with any key count and K/V strides
    (each run takes them from its call), so ops.run_forward keeps one per key-count bucket: a
    decoding loop over a growing cache builds it once (unless it fell back)."""
    __slots__ = ("variant", "plan", "descriptor", "fallback", "why", "any_seqlen_k")

    def __init__(self, q, k, v, causal: bool, scale: float | None, variant: Variant,
                 masks=None):
        self.fallback, self.why, self.any_seqlen_k = None, "", False
        if masks is not None:
            self.why = block_mask_blocker(masks.block_mask, q.shape[2],
                                          q.shape[1] // k.shape[1], variant.paged)
        if self.why:
            from .launch import generic_plan
            self.fallback = generic_plan(q, k, v, causal, scale, masks)
            self.variant, self.plan = self.fallback.variant, None
            self.descriptor = self.fallback.descriptor
            return
        if variant.loads == "descriptor" and not descriptor_ok(k.transpose(1, 2),
                                                               v.transpose(1, 2), False):
            variant = dataclasses.replace(variant, loads="pointer")
        self.variant = variant
        self.plan = SplitKVPlan(q.transpose(1, 2), k.transpose(1, 2), causal, scale, variant,
                                masks)
        # ops.run_forward checks each call's base addresses for TMA (strides: above, and their
        # alignment is part of its bucket key)
        self.descriptor = variant.loads == "descriptor"
        self.any_seqlen_k = True

    def run(self, q, k, v):
        if self.fallback is not None:
            return self.fallback.run(q, k, v)
        o, lse = self.plan.run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                               None, k.shape[2])
        return o.transpose(1, 2), lse
