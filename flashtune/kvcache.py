"""Public API: flashtune.attention_with_kvcache -- decoding over a (paged) KV cache with the
split-KV (Flash-Decoding) kernels. Inference only: no autograd."""
from __future__ import annotations

import dataclasses

import torch

from . import dispatch
from .checked import CheckedValues
from .launch_splitkv import SplitKVPlan, descriptor_ok
from .masks import NONE, Masks, check_softcap, check_window, window_keys
from .problem import Problem, dtype_name, log2_bucket
from .validate import SUPPORTED_DTYPES, check_causal_scale, check_device, check_heads

__all__ = ["attention_with_kvcache"]

PAGE_MULTIPLE = 16


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None,
                           block_table: torch.Tensor | None = None, causal: bool = False,
                           scale: float | None = None, return_lse: bool = False,
                           window: tuple[int, int] | None = None, softcap: float | None = None):
    """Attention of q over a KV cache, flash_attn_with_kvcache's layout and meaning.

    q: (batch, seqlen_q, heads, head_dim). k_cache, v_cache: (batch, seqlen_cache, kv_heads,
    head_dim), or -- with block_table (batch, max_pages) int32 -- paged (num_pages, page_size,
    kv_heads, head_dim), page_size a multiple of 16, key j of sequence b at page
    block_table[b, j // page_size], row j % page_size. heads a multiple of kv_heads (GQA/MQA).
    cache_seqlens: int32 tensor (batch,) or an int: the keys already in each sequence's cache.
    k, v (optional, together): (batch, seqlen_new, kv_heads, head_dim), written into the cache in
    place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending;
    attention then covers cache_seqlens[b] + seqlen_new keys (cache_seqlens itself is not
    updated, as in flash_attn). causal: bottom-right aligned per sequence: query token i of a
    sequence with L keys sees key j iff j <= i + L - seqlen_q. A query that sees no key (e.g. an
    empty cache) returns zeros, and LSE -inf. scale defaults to 1/sqrt(head_dim).
    Returns O (batch, seqlen_q, heads, head_dim) in q's dtype; with return_lse=True also the LSE
    (batch, heads, seqlen_q) float32, natural log.
    window, softcap: as flashtune.attention (flash_attn's window_size and softcap), per sequence:
    token i of a sequence with L keys sees keys [i + L - seqlen_q - left, i + L - seqlen_q +
    right]; splits outside the window load nothing.
    Inference only: the result carries no gradient (like flash_attn_with_kvcache).
    Validation reads cache_seqlens and block_table on the host (a device->host sync) so that no
    bad value can make a kernel read or write out of bounds; all checks run before the cache is
    written or any kernel launched.
    """
    seqlens, total, max_total = _validate(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                          causal, scale, return_lse)
    masks = NONE
    if window is not None or softcap is not None:
        # a window is trimmed against the cache's capacity, not this call's lengths: a CUDA
        # graph replayed after the caches grew runs the same kernels
        capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                    else k_cache.shape[1])
        window = check_window(window, causal, q.shape[1], capacity)
        softcap = check_softcap(softcap)
        if window is not None or softcap is not None:
            masks = Masks(window, softcap)
    paged = block_table is not None
    with torch.no_grad():
        if k is not None and k.shape[1]:
            _append(k_cache, v_cache, k, v, seqlens, block_table)
        if q.numel():
            if paged and block_table.stride(1) != 1:
                block_table = block_table.contiguous()
            plan = _plan(q, k_cache, v_cache, paged, causal, scale, max_total, masks)
            o, lse = plan.run(q, k_cache, v_cache, total, block_table, max_total,
                              appended=k.shape[1] if k is not None else 0)
        else:
            o = torch.empty_like(q)
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                              device=q.device)
    return (o, lse) if return_lse else o


# call signature -> SplitKVPlan: a decode step pays for the checks, one dict lookup and the
# launches. The cache's length enters on a log scale (the dispatcher's bucket of it), so a growing
# cache re-plans once per octave; cleared with the dispatcher's lookups.
_plans: dict = {}
dispatch.on_clear(_plans.clear)


def _plan(q, k_cache, v_cache, paged: bool, causal: bool, scale, max_total: int,
          masks: Masks = NONE) -> SplitKVPlan:
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
           v_cache.stride(), paged, causal, scale, log2_bucket(max_total),
           dispatch.forced_variant(),
           k_cache.data_ptr() & 15 == 0 and v_cache.data_ptr() & 15 == 0)
    if masks.any:
        key += masks.key
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= 4096:
            _plans.clear()
        plan = _plans[key] = SplitKVPlan(q, k_cache, causal, scale,
                                         _variant(q, k_cache, v_cache, paged, causal, max_total,
                                                  masks), masks)
    return plan


def _variant(q, k_cache, v_cache, paged: bool, causal: bool, max_total: int,
             masks: Masks = NONE):
    """The dispatcher's splitkv variant for this call (forced, tuned DB, or the default), fitted
    to the cache: paged or not, a key block inside one page, TMA only where it can address,
    the masks' code rendered in."""
    b, nq, h, d = q.shape
    nk = max(1, max_total)
    problem = Problem("splitkv", dtype_name(q.dtype), d, causal, h // k_cache.shape[2], b, h, nq,
                      nk, window=0 if masks.window is None else
                      max(1, round(window_keys(nq, nk, causal, masks.window))),
                      softcap=masks.softcap is not None)
    variant = dispatch.select(problem)
    if masks.any or variant.masks:
        variant = dataclasses.replace(variant, **masks.structure)
    variant = fit_pages(variant, k_cache.shape[1] if paged else None)
    if variant.loads == "descriptor" and not descriptor_ok(k_cache, v_cache, paged):
        variant = dataclasses.replace(variant, loads="pointer")
    return variant


def fit_pages(variant, page: int | None):
    """variant for a paged cache of `page`-key pages (None: contiguous): Variant.paged follows
    the cache, and a key block lies in one page."""
    if variant.paged != (page is not None):
        variant = dataclasses.replace(variant, paged=page is not None)
    if page is not None and page % variant.block_n:
        # the gluon render's tile lies in one page and keeps its width: the Triton render here
        variant = dataclasses.replace(variant, gluon=False)
        # a k times shorter step pipelines k times deeper, keeping the bytes in flight and the
        # shared memory the record was tuned with (the H100's n128-s1 records ran as n64-s1 at
        # 0.90x of contiguous, B=32, GQA). page & -page: the largest power of two dividing it
        n = min(variant.block_n, page & -page)
        variant = dataclasses.replace(
            variant, block_n=n, num_stages=min(8, variant.num_stages * (variant.block_n // n)))
    return variant


def _append(k_cache, v_cache, k, v, seqlens, block_table):
    """seqlens: the (B,) int32 tensor, or an int shared by every sequence."""
    b, n_new = k.shape[:2]
    start = seqlens.to(torch.int64)[:, None] if isinstance(seqlens, torch.Tensor) else seqlens
    pos = (start + torch.arange(n_new, device=k.device)).expand(b, n_new)  # (B, Nnew)
    if block_table is None:
        rows = torch.arange(b, device=k.device)[:, None].expand(b, n_new)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page_size = k_cache.shape[1]
        pages = torch.gather(block_table.to(torch.int64), 1, pos // page_size)
        k_cache[pages, pos % page_size] = k
        v_cache[pages, pos % page_size] = v


# -- validation ----------------------------------------------------------------------------------
def _check_tensor(name, t, dims: int, layout: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")


def _validate(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, return_lse):
    """Raise a clear error naming the bad argument. Returns (cache_seqlens: the int32 tensor on
    q's device, or the int; the total keys per sequence as a tensor, or None for an int; the
    largest total as a host int)."""
    _check_tensor("q", q, 4, "(batch, seqlen_q, heads, head_dim)")
    paged = block_table is not None
    cache_layout = ("(num_pages, page_size, kv_heads, head_dim)" if paged
                    else "(batch, seqlen_cache, kv_heads, head_dim)")
    _check_tensor("k_cache", k_cache, 4, cache_layout)
    _check_tensor("v_cache", v_cache, 4, cache_layout)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q.dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype ({t.dtype}) must match q.dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    check_heads(q, k_cache, v_cache, head_axis=2, names=("q", "k_cache", "v_cache"))
    b, nq, h, d = q.shape
    hk = k_cache.shape[2]
    check_causal_scale(causal, scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_device(q)

    # new keys and values
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append)")
    n_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, 4, "(batch, seqlen_new, kv_heads, head_dim)")
            if t.dtype != k_cache.dtype:
                raise TypeError(f"{name}.dtype ({t.dtype}) must match the cache's "
                                f"({k_cache.dtype})")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v "
                             f"{tuple(v.shape)}")
        if k.shape[0] != b or k.shape[2] != hk or k.shape[3] != d:
            raise ValueError(f"k and v must be (batch={b}, seqlen_new, kv_heads={hk}, "
                             f"head_dim={d}), got {tuple(k.shape)}")
        n_new = k.shape[1]

    # paging
    if paged:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got "
                            f"{type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table.dtype must be torch.int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table must be (batch={b}, max_pages), got "
                             f"{tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        page_size = k_cache.shape[1]
        if page_size == 0 or page_size % PAGE_MULTIPLE:
            raise ValueError(f"page size (k_cache.shape[1]) must be a positive multiple of "
                             f"{PAGE_MULTIPLE}, got {page_size}")
        capacity = block_table.shape[1] * page_size
        where = f"the {block_table.shape[1]} pages of a block_table row x page size {page_size}"
    else:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache and v_cache must have q's batch ({b}), got "
                             f"{k_cache.shape[0]}")
        capacity = k_cache.shape[1]
        where = f"the cache's {capacity} positions (k_cache.shape[1])"

    # cache_seqlens
    if isinstance(cache_seqlens, bool):
        raise TypeError("cache_seqlens must be an int or an int32 tensor (batch,), got bool")
    if isinstance(cache_seqlens, int):
        # one length for all: the kernels take it as an argument (UNIFORM), so no tensor is made
        host = [cache_seqlens] * b
        seqlens = None
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens.dtype must be torch.int32, got {cache_seqlens.dtype}")
        if cache_seqlens.shape != (b,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({b},), got "
                             f"{tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on "
                             f"{q.device}")
        seqlens = cache_seqlens
        host = None
    else:
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor (batch,), got "
                        f"{type(cache_seqlens).__name__}")
    bounds = (capacity, n_new, k_cache.shape[0], k_cache.shape[1], paged,
              None if host is None else cache_seqlens)
    tensors = (seqlens, block_table)
    memo = seqlens is not None or paged  # an int without a table: checked on the host for free
    max_total = _checked.get(tensors, bounds) if memo else None
    if max_total is None:
        # device->host copies of cache_seqlens and (paged) block_table, once per their versions
        max_total = _check_values(host if host is not None else seqlens.tolist(),
                                  block_table, capacity, n_new, where, k_cache)
        if memo:
            _checked.put(tensors, bounds, max_total)
    if seqlens is None:  # uniform lengths: (the int, None, the keys after the append)
        return cache_seqlens, None, max_total
    total = (seqlens + n_new if n_new else seqlens).contiguous()
    return seqlens, total, max_total


def _check_values(host: list, block_table, capacity: int, n_new: int, where: str,
                  k_cache) -> int:
    """The values of cache_seqlens (host: as a list) and, paged, of the block_table entries
    they use: every key and every page inside the cache. Returns the longest sequence after
    the append."""
    b = len(host)
    if b and min(host) < 0:
        i = host.index(min(host))
        raise ValueError(f"cache_seqlens[{i}] = {host[i]} is negative")
    if b and max(host) > capacity:
        i = host.index(max(host))
        raise ValueError(f"cache_seqlens[{i}] = {host[i]} is beyond {where}")
    max_total = max(host) + n_new if b else 0
    if max_total > capacity:
        i = host.index(max(host))
        raise ValueError(f"appending k/v ({n_new} new keys) at cache_seqlens[{i}] = "
                         f"{host[i]} goes past {where}")
    if block_table is not None and b:
        # every page a sequence uses (cached and appended keys) must exist
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        used = (torch.tensor(host) + (n_new + page_size - 1)) // page_size  # (B,)
        bt = block_table.to("cpu")  # device->host copy
        col = torch.arange(bt.shape[1])[None, :]
        bad = (col < used[:, None]) & ((bt < 0) | (bt >= num_pages))
        if bool(bad.any()):
            bi, pi = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"block_table[{bi}, {pi}] = {int(bt[bi, pi])} is out of range: "
                             f"pages are 0..{num_pages - 1} (k_cache.shape[0] = {num_pages})")
    return max_total


# values already checked (one device->host copy per decoding step, not per layer)
_checked = CheckedValues()
