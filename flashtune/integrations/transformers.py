"""flashtune as an attention implementation of Hugging Face transformers.

    import flashtune.integrations.transformers as ft_hf
    ft_hf.register()                                  # once per process; returns NAME
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ft_hf.NAME)
    model.set_attn_implementation(ft_hf.NAME)         # or switch a loaded model

`register()` adds `attention_forward` to transformers' `AttentionInterface` and `padding_mask`
to its `AttentionMaskInterface` under the name `NAME = "ft_attention"`. Training, padded
batches and `generate()` with a cache (dynamic or static) then run on `flashtune.attention` /
`flashtune.attention_varlen`.

Why "ft_attention" and not "flashtune": transformers reads meaning into implementation names.
Any name containing "flash" is taken for a FlashAttention flavour
(`transformers.utils.generic.is_flash_attention_requested`): the model then tries to load
`flash_attn` or a hub kernel for it (`lazy_import_flash_attention`) and fails. A name shaped
like "org/repo" (`integrations.hub_kernels.is_kernel`) is fetched from the Hub; names
containing "sdpa" or "flex_attention" get those backends' checks, and a "paged|" prefix is
stripped. `register(name=...)` accepts another name and refuses these patterns.

How masks reach the kernel. transformers builds the mask once per forward through the mask
function registered for the implementation; ours (`padding_mask`) does what the
FlashAttention-2 integration's does: it hands the attention a 2D boolean padding mask
(batch, keys) or None when no key is padding, never a 4D float mask. The attention then:

- mask None: one dense `flashtune.attention` call, K/V with their own (kv) heads (GQA without
  `repeat_kv`), causal bottom-right aligned, which is what decoding needs (1 query against
  past + 1 keys).
- 2D mask with padding: the tokens with mask 1 are gathered into packed sequences and run
  through `flashtune.attention_varlen` (no work on padding, no attention to it); the output is
  scattered back, zeros at padded query positions. Keys are the mask's valid columns. With
  as many queries as keys every query row is unpadded by the mask too; with fewer queries
  (a forward with a cache: prefill continuation or decoding) the queries are the mask's
  last Nq columns, so left padding (what `generate()` uses) is right, and causal stays
  bottom-right per sequence. Non-causal attention with fewer queries than keys
  (cross-attention) keeps every query.
- a mask shorter than the keys (a static cache: keys hold the whole preallocated length) cuts
  the keys to the mask; with no mask and a static cache the mask function hands over the
  all-ones mask of the filled length, so the empty cache slots are never attended.
- packed sequences without padding (batch rows holding several sequences, marked by
  `position_ids` that restart, or `cu_seq_lens_q/k` + `max_length_q/k` keyword arguments as
  `DataCollatorWithFlattening` gives) run as varlen too, one sequence per segment.

Sliding windows and softcapping (Mistral, Gemma 2/3) run as flashtune's `window=` and
`softcap=`, with the FlashAttention-2 integration's meaning: `sliding_window` W is
`window=(W - 1, W - 1)` (causal: W - 1 keys back plus the token itself), applied only when
there are more than W keys.

Not supported (a clear error instead of a wrong answer): dropout > 0 (flashtune has no
dropout), attention sinks (`s_aux`), additive position biases,
4D custom masks, transformers' paged (continuous-batching) cache. `output_attentions` gives
no weights (None, as FlashAttention and SDPA).
"""
from __future__ import annotations

import weakref

import torch

NAME = "ft_attention"
__all__ = ["NAME", "register", "attention_forward", "padding_mask"]

_INSTALL_HINT = "pip install transformers"


def _import_transformers():
    try:
        import transformers  # noqa: F401
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "flashtune.integrations.transformers needs Hugging Face transformers, an optional "
            f"dependency of flashtune: `{_INSTALL_HINT}` (failed: {e})") from e
    return AttentionInterface, AttentionMaskInterface


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    low = name.lower()
    bad = None
    if "flash" in low:
        bad = ('contains "flash": transformers then takes it for a FlashAttention flavour and '
               "tries to load flash_attn or a Hub kernel for it")
    elif "/" in name or ":" in name:
        bad = 'contains "/" or ":": transformers takes an "org/repo" name for a Hub kernel'
    elif "sdpa" in low or "flex_attention" in low or low == "eager":
        bad = "names or contains one of transformers' own backends (sdpa, flex_attention, eager)"
    elif low.startswith("paged|"):
        bad = 'starts with "paged|", which transformers strips'
    if bad:
        raise ValueError(f"attention implementation name {name!r} {bad}; use e.g. {NAME!r}")


def register(name: str = NAME) -> str:
    """Register flashtune with transformers' AttentionInterface and AttentionMaskInterface.

    Idempotent. Returns the name to pass as `attn_implementation` (default `NAME`,
    "ft_attention"). Raises ImportError naming `pip install transformers` if it is missing.
    """
    _check_name(name)
    AttentionInterface, AttentionMaskInterface = _import_transformers()
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


# ---------------------------------------------------------------------------------------------
# mask function: what `attention_mask` the attention function receives


def padding_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None,
                 q_offset=0, kv_offset: int = 0, mask_function=None,
                 attention_mask: torch.Tensor | None = None, cache_position=None, **kwargs):
    """AttentionMaskInterface entry: a 2D bool padding mask (batch, keys), or None if no key is
    padding. As transformers' FlashAttention-2 mask function, plus the static-cache case: with
    no padding but more key slots than tokens seen, the all-ones mask of the filled length.
    (transformers >= 5.1 passes q_length and q_offset, 5.0 passes cache_position instead.)"""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    if kv_offset != 0:  # a sliding window layer (refused by the attention function)
        return None
    if cache_position is not None:
        filled = cache_position[-1] + 1
    elif q_length is not None:
        filled = q_offset + q_length
    else:
        return None
    filled = int(filled)  # a host sync where the offset is a tensor (static cache, transformers 5.0)
    if filled < kv_length:
        device = kwargs.get("device") or getattr(cache_position, "device", None)
        return torch.ones(batch_size, filled, dtype=torch.bool, device=device)
    return None


# ---------------------------------------------------------------------------------------------
# attention function


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs):
    """AttentionInterface entry. query (B, H, Nq, D), key/value (B, Hkv, Nk, D) as transformers
    hands them (kv heads not repeated); returns ((B, Nq, H, D) output, None)."""
    if dropout:
        raise ValueError(
            f"flashtune has no attention dropout (got dropout={dropout}): set the model's "
            "config.attention_dropout to 0, or call model.eval(), to train or run with "
            "flashtune's attention implementation")
    for kw in ("s_aux", "position_bias"):
        if kwargs.get(kw) is not None:
            raise NotImplementedError(
                f"flashtune's transformers backend does not support `{kw}` "
                "(attention sinks / additive position biases); use 'eager' or 'sdpa'")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise NotImplementedError(
            "flashtune's transformers backend does not support transformers' paged cache "
            "(continuous batching); use generate() with its default cache")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"flashtune's transformers backend takes padding masks (batch, keys) only, got a "
            f"{attention_mask.dim()}D mask {tuple(attention_mask.shape)}: custom 4D masks need "
            "'sdpa' or 'eager'. (Is the model's mask built by transformers' create_causal_mask?)")

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    deterministic = bool(kwargs.get("deterministic") or torch.are_deterministic_algorithms_enabled())
    if key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:  # flashtune wants one head dim for q, k and v (e.g. MLA's is smaller)
        if v_head_dim > head_dim:
            raise NotImplementedError(f"value head dim {v_head_dim} > query head dim {head_dim}")
        value = torch.nn.functional.pad(value, [0, head_dim - v_head_dim])

    if attention_mask is not None and key.shape[2] > attention_mask.shape[1]:
        # a static cache: keys span its preallocated length, the mask the tokens it holds
        key = key[:, :, :attention_mask.shape[1]]
        value = value[:, :, :attention_mask.shape[1]]

    # as transformers' FlashAttention-2 integration: W - 1 each side, only when it cuts keys
    masks = {}
    if sliding_window is not None and key.shape[2] > sliding_window:
        masks["window"] = (sliding_window - 1, sliding_window - 1)
    if softcap is not None:
        masks["softcap"] = softcap
    packed = None
    if attention_mask is None:
        packed = _packed_from_kwargs(query, key, kwargs)
    if attention_mask is not None or packed is not None:
        out = _varlen(query, key, value, attention_mask, packed, causal, scaling, deterministic,
                      masks)
    else:
        import flashtune
        out = flashtune.attention(query, key, value, causal=causal, scale=scaling,
                                  deterministic=deterministic, **masks).transpose(1, 2)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out.contiguous(), None


# one-slot memo: every layer of a forward gets the same mask / position_ids tensor, so the index
# work (and its device->host syncs) runs once per forward, not once per layer
_memo: dict = {}


def _memoized(kind: str, t: torch.Tensor, extra: tuple, compute):
    from ..launch import capturing
    # Not kept: tensors made during CUDA-graph capture, and anything under torch.compile (which
    # traces this function: generate() with a static cache compiles the model with CUDA graph
    # trees, whose memory pool may hold no tensor past a replay but its outputs -- a kept index
    # tensor failed that check on the H100)
    if torch.compiler.is_compiling() or capturing(t):
        return compute()
    hit = _memo.get(kind)
    if hit is not None and hit[0]() is t and hit[1] == (t._version, *extra):
        return hit[2]
    value = compute()
    _memo[kind] = (weakref.ref(t), (t._version, *extra), value)  # a memo keeps no mask alive
    return value


def _unpad(mask: torch.Tensor):
    """bool (B, N) -> (batch idx, position idx) of valid tokens, int32 cu_seqlens, max length."""
    mask = mask.bool()
    b, n = mask.nonzero(as_tuple=True)
    lens = mask.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return b, n, cu, int(lens.max()) if lens.numel() else 0


def _segments(position_ids: torch.Tensor):
    """(B, N) position ids -> cu_seqlens of the runs of +1 steps over the flattened B*N tokens
    (a new sequence wherever the position does not follow the previous one, as transformers'
    packed-sequence mask), and the longest run; None if every row is one run."""
    pos = position_ids
    step = torch.diff(pos, dim=-1) != 1
    if not bool(step.any()):
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = step
    idx = starts.flatten().nonzero().flatten().to(torch.int32)
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([idx, total])
    return cu, int(cu.diff().max())


def _packed_from_kwargs(query, key, kwargs):
    """Packed sequences in unpadded rows: (cu_q, cu_k, max_q, max_k), or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    pos = kwargs.get("position_ids")
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if pos is None or nq != nk or nq == 1 or pos.dim() != 2 or pos.shape[-1] != nq:
        return None
    seg = _memoized("segments", pos, (tuple(pos.shape), b),
                    lambda: _segments(pos.expand(b, -1) if pos.shape[0] != b else pos))
    if seg is None:
        return None
    cu, mx = seg
    return cu, cu, mx, mx


def _varlen(query, key, value, mask, packed, causal, scale, deterministic, masks):
    import flashtune
    bsz, h, nq, d = query.shape
    nk = key.shape[2]
    q = query.transpose(1, 2)  # (B, Nq, H, D) views
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if packed is not None:  # no padding: every token of every row, cut into sequences
        cu_q, cu_k, max_q, max_k = packed
        out = flashtune.attention_varlen(
            q.reshape(bsz * nq, h, d), k.reshape(bsz * nk, k.shape[2], d),
            v.reshape(bsz * nk, v.shape[2], d), cu_q, cu_k, max_q, max_k,
            causal=causal, scale=scale, deterministic=deterministic, **masks)
        return out.view(bsz, nq, h, d)

    def keys_and_queries():
        kb, kn, cu_k, max_k = _unpad(mask)
        if nq == nk:
            return (kb, kn, cu_k, max_k), (kb, kn, cu_k, max_k)
        if not causal:  # cross-attention: the mask pads keys only
            return (kb, kn, cu_k, max_k), _unpad(torch.ones(bsz, nq, dtype=torch.bool,
                                                            device=mask.device))
        # queries are the last Nq tokens of the keys (a cache): their mask is the last columns
        return (kb, kn, cu_k, max_k), _unpad(mask[:, -nq:])

    (kb, kn, cu_k, max_k), (qb, qn, cu_q, max_q) = _memoized(
        "unpad", mask, (tuple(mask.shape), nq, causal), keys_and_queries)
    out = flashtune.attention_varlen(q[qb, qn], k[kb, kn], v[kb, kn], cu_q, cu_k, max_q, max_k,
                                     causal=causal, scale=scale, deterministic=deterministic,
                                     **masks)
    full = query.new_zeros(bsz, nq, h, d)
    return full.index_put((qb, qn), out)
