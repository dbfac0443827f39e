"""The implementations `flashtune bench` times side by side. Each peer says why it cannot run a
case (`why_not`: no CUDA, a missing backend or argument) before anything is built, or raises
Unavailable while preparing; the runner records either as a skipped cell, and any other
exception as an error cell -- never a crash of the run.

A peer's prepare(case, inputs) returns fn(*inputs.tensors) -> output in the case's layout
(dense: (B, H, N, D); decode: (B, 1, H, D); varlen: (total, H, D)), so outputs compare and the
runner can time forward, backward and both alike.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch

from .grid import MASKS, SECTIONS, BlockSparseMask, Case, WindowMask

ALL = SECTIONS


class Unavailable(Exception):
    """This peer cannot run this case here (not a failure of the peer)."""


@dataclass
class Inputs:
    tensors: tuple                   # what fn takes: q, k, v (differentiable for bwd)
    extra: dict = field(default_factory=dict)


def make_inputs(case: Case, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    b, h, hk, d = case.batch, case.heads, case.kv_heads, case.head_dim
    if case.section == "decode":
        q, kc, vc = rand(b, 1, h, d), rand(b, case.seqlen_k, hk, d), rand(b, case.seqlen_k, hk, d)
        seqlens = torch.full((b,), case.seqlen_k, dtype=torch.int32, device=device)
        return Inputs((q, kc, vc), {"cache_seqlens": seqlens})
    if case.section == "varlen":
        total = sum(case.lengths)
        cu = torch.tensor((0,) + case.lengths, device=device).cumsum(0).to(torch.int32)
        return Inputs((rand(total, h, d), rand(total, hk, d), rand(total, hk, d)),
                      {"cu_seqlens": cu, "max_seqlen": max(case.lengths)})
    if case.section == "bnhd":  # (B, H, N, D) views of (B, N, H, D) memory
        return Inputs((rand(b, case.seqlen_q, h, d).transpose(1, 2),
                       rand(b, case.seqlen_k, hk, d).transpose(1, 2),
                       rand(b, case.seqlen_k, hk, d).transpose(1, 2)))
    return Inputs((rand(b, h, case.seqlen_q, d), rand(b, hk, case.seqlen_k, d),
                   rand(b, hk, case.seqlen_k, d)))


class Peer:
    name = ""
    doc = ""
    sections: tuple = ALL

    def why_not(self, case: Case, device: str) -> str | None:
        return None

    def context(self, case: Case):
        return contextlib.nullcontext()

    def prepare(self, case: Case, inp: Inputs):
        raise NotImplementedError


# -- flashtune ----------------------------------------------------------------------------------
def missing_argument(fn, name: str) -> str | None:
    """A note when `fn` lacks keyword `name` (a mask this flashtune does not have yet)."""
    if name in inspect.signature(fn).parameters:
        return None
    return f"not available in this flashtune: {fn.__name__}() has no {name}= argument"


class Flashtune(Peer):
    def __init__(self, tuned: bool = True):
        self.tuned = tuned
        self.name = "flashtune" if tuned else "flashtune-defaults"
        self.doc = ("flashtune as dispatched (tuned DB, shipped tables, defaults)" if tuned else
                    "flashtune with the built-in defaults only (tuned records off)")
        self.sections = ALL if tuned else tuple(s for s in ALL if s != "memory")

    def why_not(self, case, device):
        from ..env import triton_interprets
        if device != "cuda" and not triton_interprets():
            return "Triton kernels need CUDA here (or TRITON_INTERPRET=1 before Python starts)"
        if case.mask:
            import flashtune
            return missing_argument(flashtune.attention, MASKS[case.mask].argument)
        return None

    def context(self, case: Case):
        if self.tuned:
            return contextlib.nullcontext()
        from ..dispatch import builtin_defaults
        return builtin_defaults()

    def prepare(self, case, inp):
        import flashtune
        c = case.causal
        if case.section == "decode":
            seqlens = inp.extra["cache_seqlens"]
            return lambda q, kc, vc: flashtune.attention_with_kvcache(q, kc, vc,
                                                                      cache_seqlens=seqlens)
        if case.section == "varlen":
            cu, mx = inp.extra["cu_seqlens"], inp.extra["max_seqlen"]
            return lambda q, k, v: flashtune.attention_varlen(q, k, v, cu, cu, mx, mx, causal=c)
        kw = {}
        if case.mask:
            mask = MASKS[case.mask]
            kw = mask.flashtune_kwargs(case)
            if isinstance(mask, BlockSparseMask):
                # flashtune's own BlockMask from the same blocks (Flex's is not its type)
                kw["block_mask"] = flashtune.BlockMask.from_dense(
                    mask.blocks(case).to(inp.tensors[0].device),
                    (case.seqlen_q, case.seqlen_k), mask.block)
        return lambda q, k, v: flashtune.attention(q, k, v, causal=c, **kw)


def shuffled_table(batch: int, per: int, device) -> torch.Tensor:
    """A (batch, per) int32 block table: sequence b's pages b * per .. (b + 1) * per - 1 in an
    order shuffled by a CPU generator seeded 0 (the same table every run)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return torch.stack([b * per + torch.randperm(per, generator=gen)
                        for b in range(batch)]).to(device=device, dtype=torch.int32)


class Paged(Flashtune):
    """flashtune's decoding over the same cache cut into pages: each sequence's pages in a
    shuffled order through the block table (same bytes, same result -- one query token sees
    every key -- scattered reads), one table for every layer of a step."""

    def __init__(self, page: int = 256):
        super().__init__(True)
        self.page = page
        self._tables: dict = {}  # case -> its block table: one for every layer, as a server has
        self.name = f"flashtune-paged{page}"
        self.doc = (f"flashtune decoding a paged cache ({page}-token pages, each sequence's "
                    "pages shuffled)")
        self.sections = ("decode",)

    def prepare(self, case, inp):
        import flashtune
        page, n = self.page, case.seqlen_k
        if n < 2 * page:  # a short cache (the CPU smoke run): the smallest page, still shuffled
            page = 16
        if n % page:
            raise Unavailable(f"Nk={n} is not a multiple of the page size {page}")
        per = n // page
        dev = inp.tensors[0].device
        table = self._tables.get(case)
        if table is None or table.device != dev:
            table = shuffled_table(case.batch, per, dev)
            self._tables = {case: table}
        seqlens = inp.extra["cache_seqlens"]

        def paged(t):  # (B, N, Hk, D) -> (B * N / page, page, Hk, D), no copy
            return t.view(-1, page, *t.shape[2:])
        def run(q, kc, vc):
            return flashtune.attention_with_kvcache(q, paged(kc), paged(vc),
                                                    cache_seqlens=seqlens, block_table=table)
        if page != self.page:
            run.note = f"pages of {page} tokens (the cache is shorter than two of {self.page})"
        return run


class PlainRead(Peer):
    """Not attention: the decode cell's K and V caches streamed once by a plain Triton kernel,
    timed like the peers (flashtune/bench/read_ceiling.py). Its GB/s is what the device reads
    those bytes at, launch and ramp included: a decode step's ceiling for that cell."""
    name = "plain-read"
    doc = ("not attention: the same K/V caches streamed once by a plain read kernel (the "
           "cell's read ceiling; fastest of 1, 2, 4, 8 programs per SM)")
    sections = ("decode",)

    def __init__(self):
        self._programs: dict = {}  # case -> the grid chosen on its first layer's caches

    def why_not(self, case, device):
        from ..env import triton_interprets
        if device != "cuda" and not triton_interprets():
            return "Triton kernels need CUDA here (or TRITON_INTERPRET=1 before Python starts)"
        return None

    def prepare(self, case, inp):
        kc, vc = inp.tensors[1], inp.tensors[2]
        if kc.device.type != "cuda":  # the interpreter (a smoke run): one program, no timing
            return self._step(1)
        if case not in self._programs:  # every layer of the step reads with the same grid
            self._programs = {case: self._fastest(kc, vc)}
        return self._step(self._programs[case])

    @staticmethod
    def _fastest(kc, vc) -> int:
        """The program count that reads kc and vc fastest (a few timed runs each, L2 flushed)."""
        from .. import timing
        from .read_ceiling import fastest, reader

        def time_of(programs):
            read = reader(kc, vc, programs)
            read()  # compiled outside the timing
            return min(timing.samples(read, 5, 256 << 20))
        sms = torch.cuda.get_device_properties(kc.device).multi_processor_count
        return fastest(sms, time_of)[1]

    @staticmethod
    def _step(programs: int):
        from .read_ceiling import reader

        def read(q, kc, vc):  # each layer's caches: the step calls it on every layer's inputs
            return reader(kc, vc, programs)()
        read.note = f"{programs} programs"
        return read


class Forced(Flashtune):
    """flashtune pinned to given variants, one per head dim (force(): a sweep's winner, a dQ
    scheme). A bwd variant pins the backward only; the forward stays dispatched."""

    def __init__(self, name: str, variants: dict, doc: str = ""):
        super().__init__(True)
        self.name, self.variants = name, dict(variants)
        self.doc = doc or "flashtune forced to " + ", ".join(
            f"D={d}: {v.name}" for d, v in sorted(self.variants.items()))
        self.sections = ("dense", "masks", "memory", "bnhd")

    def why_not(self, case, device):
        if case.head_dim not in self.variants:
            return f"no forced variant for D={case.head_dim}"
        return super().why_not(case, device)

    def context(self, case: Case):
        from ..dispatch import force
        return force(self.variants[case.head_dim])


# -- SDPA ---------------------------------------------------------------------------------------
class Sdpa(Peer):
    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"sdpa-{backend}"
        self.doc = f"torch SDPA, {backend} backend"
        if backend == "math":
            self.doc += " (memory table only: the N x N baseline)"
            self.sections = ("memory",)

    def why_not(self, case, device):
        if device != "cuda":
            return f"SDPA's {self.backend} backend is timed on CUDA only"
        if case.mask == "softcap":
            return "SDPA has no logit softcap"
        if case.mask and self.backend == "flash":
            return "SDPA's flash backend takes no attn_mask"
        return None

    def context(self, case: Case):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION,
                            "cudnn": SDPBackend.CUDNN_ATTENTION,
                            "efficient": SDPBackend.EFFICIENT_ATTENTION,
                            "math": SDPBackend.MATH}[self.backend])

    def prepare(self, case, inp):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        c = case.causal
        if case.section == "decode":
            return self._decode(case, inp, sdpa)
        if case.section == "varlen":
            offsets = inp.extra["cu_seqlens"].long()

            def jagged(t):  # (total, H, D) -> nested (B, H, j, D), no copy
                return torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
            return lambda q, k, v: sdpa(jagged(q), jagged(k), jagged(v),
                                        is_causal=c).transpose(1, 2).values()
        if case.mask:
            keep = dense_mask(case, inp.tensors[0].device)
            return lambda q, k, v: sdpa(q, k, v, attn_mask=keep)
        return lambda q, k, v: sdpa(q, k, v, is_causal=c)


    @staticmethod
    def _decode(case, inp, sdpa):
        """SDPA on the cache in place, (B, N, Hk, D) viewed as (B, Hk, N, D): GQA through
        enable_gqa where the backend takes it, else K/V repeated per q head (more bytes read
        than the GB/s counts: noted in the row)."""
        def run(q, kc, vc):
            return sdpa(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                        enable_gqa=case.heads != case.kv_heads).transpose(1, 2)
        if case.heads == case.kv_heads:
            return run
        try:
            run(*inp.tensors)
            return run
        except RuntimeError:
            group = case.heads // case.kv_heads

            def repeated(q, kc, vc):
                k, v = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (kc, vc))
                return sdpa(q.transpose(1, 2), k, v).transpose(1, 2)
            repeated.note = "no enable_gqa in this backend: K/V repeated per q head in the call"
            return repeated


def dense_mask(case: Case, device) -> torch.Tensor:
    """The case's mask as a boolean (Nq, Nk) tensor, True = attend (SDPA's attn_mask)."""
    i = torch.arange(case.seqlen_q, device=device)[:, None]
    j = torch.arange(case.seqlen_k, device=device)[None, :]
    mask = MASKS[case.mask]
    if isinstance(mask, WindowMask):
        return (j <= i) & (j > i - mask.left)
    if isinstance(mask, BlockSparseMask):
        qb, kb = i // mask.block, j // mask.block
        return (qb == kb) | (kb % mask.stride == 0)
    raise Unavailable(f"no dense form of mask {case.mask!r}")


# -- FlexAttention ------------------------------------------------------------------------------
@functools.cache
def compiled_flex(dynamic: bool = False):
    from torch.nn.attention.flex_attention import flex_attention
    # one compile per shape (as a model compiles it); past dynamo's default limit of 8 it would
    # fall back to eager flex, which materializes the scores: not what is being measured
    import torch._dynamo.config as dynamo
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(dynamo, knob):
            setattr(dynamo, knob, max(getattr(dynamo, knob), 1024))
    return torch.compile(flex_attention, dynamic=dynamic)


def _mask_mod(causal: bool, mask):
    if isinstance(mask, WindowMask):
        w = mask.left
        return lambda b, h, q, k: (k <= q) & (k > q - w)
    if isinstance(mask, BlockSparseMask):
        blk, st = mask.block, mask.stride
        return lambda b, h, q, k: (q // blk == k // blk) | ((k // blk) % st == 0)
    return (lambda b, h, q, k: k <= q) if causal else None


def flex_block_mask(case: Case, mask, device):
    return _block_mask(case.seqlen_q, case.seqlen_k, case.causal, mask, str(device))


@functools.lru_cache(maxsize=4)
def _block_mask(nq: int, nk: int, causal: bool, mask, device: str):
    """One BlockMask per shape and mask, shared by the passes and peers that use it."""
    from torch.nn.attention.flex_attention import create_block_mask
    mod = _mask_mod(causal, mask)
    if mod is None:
        return None
    return create_block_mask(mod, None, None, nq, nk, device=device)


class Flex(Peer):
    name = "flex"

    def __init__(self, dynamic: bool = False):
        self.dynamic = dynamic
        self.doc = ("FlexAttention under torch.compile" +
                    (" (dynamic shapes: one compile serves every N)" if dynamic else
                     " (one compile per shape)"))

    def why_not(self, case, device):
        if device != "cuda":
            return "FlexAttention is timed compiled, on CUDA only"
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as e:
            return f"no FlexAttention in this torch: {e}"
        return None

    def context(self, case: Case):
        # the bwd pass times the backward alone, again and again on one saved graph
        # (retain_graph), which a compiled backward with donated buffers refuses (H100, D=128,
        # N=16k); donating saves no time, only memory, so the memory table keeps it
        if case.section == "memory":
            return contextlib.nullcontext()
        from torch._functorch import config
        return config.patch(donated_buffer=False)

    def prepare(self, case, inp):
        from torch.nn.attention.flex_attention import create_block_mask
        flex = compiled_flex(self.dynamic)
        dev = inp.tensors[0].device
        gqa = case.heads != case.kv_heads
        if case.section == "decode":
            return lambda q, kc, vc: flex(q.transpose(1, 2), kc.transpose(1, 2),
                                          vc.transpose(1, 2), enable_gqa=gqa).transpose(1, 2)
        if case.section == "varlen":
            # the packed batch as one sequence with a document mask
            doc = torch.repeat_interleave(torch.arange(len(case.lengths), device=dev),
                                          torch.tensor(case.lengths, device=dev))
            causal = case.causal

            def same_doc(b, h, q, k):
                keep = doc[q] == doc[k]
                return keep & (k <= q) if causal else keep
            total = sum(case.lengths)
            bm = create_block_mask(same_doc, None, None, total, total, device=dev)

            def packed(t):
                return t.transpose(0, 1)[None]
            return lambda q, k, v: flex(packed(q), packed(k), packed(v), block_mask=bm,
                                        enable_gqa=gqa)[0].transpose(0, 1)
        mask = MASKS[case.mask] if case.mask else None
        bm = flex_block_mask(case, mask, dev)
        score_mod = None
        if mask is not None and mask.argument == "softcap":
            cap = mask.cap

            def score_mod(s, b, h, q, k):
                return cap * torch.tanh(s / cap)
        return lambda q, k, v: flex(q, k, v, block_mask=bm, score_mod=score_mod, enable_gqa=gqa)


def default_peers(flex_dynamic: bool = False) -> list[Peer]:
    return [Flashtune(True), Flashtune(False), Paged(), Sdpa("flash"), Sdpa("cudnn"),
            Sdpa("efficient"), Flex(flex_dynamic), Sdpa("math"), PlainRead()]


def by_names(names, flex_dynamic: bool = False) -> list[Peer]:
    known = {p.name: p for p in default_peers(flex_dynamic)}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; known: {', '.join(known)}")
    return [known[n] for n in names]
