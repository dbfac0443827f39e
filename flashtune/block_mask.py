"""flashtune.BlockMask: which (query block, key block) tiles of the score matrix attention computes.

Block-sparse attention loads and computes only the kept blocks, forward and backward, so its
cost falls with the density. A BlockMask holds, per (batch|1, head|1) and block, one of three
states -- dropped, kept in full, kept partially -- as the lists the kernels walk:

    kv_num_blocks, kv_indices            (Bm, Hm, NQB) / (Bm, Hm, NQB, NKB) int32: per query block
                                         the partial key blocks (first kv_num_blocks entries)
    full_kv_num_blocks, full_kv_indices  the key blocks kept in full (no element mask)
    q_num_blocks, q_indices,             the transpose, per key block (the backward's dK/dV
    full_q_num_blocks, full_q_indices    kernel walks queries)

as FlexAttention's BlockMask (torch.nn.attention.flex_attention) holds them, so one converts to
the other (BlockMask.from_flex). block_size = (BS_Q, BS_KV), powers of two >= 16; default 128 as
Flex's. The kernels' tiles divide it (BLOCK_M <= BS_Q, BLOCK_N <= BS_KV: a larger tuned tile is
clamped to the block size at launch).

Partial blocks carry an element mask: `mask`, a bool tensor broadcastable to (B, H, Nq, Nk)
(True = keep; broadcast dims cost no memory), read only in partial blocks. Without one, there
are no partial blocks (every kept block is kept in full). causal=, window= and softcap= of
flashtune.attention compose with a block mask (applied inside the kept blocks).
"""
from __future__ import annotations

import torch

__all__ = ["BlockMask", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 128
DROPPED, PARTIAL, FULL = 0, 1, 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _lists(state: torch.Tensor, which: int):
    """(count, indices) of the blocks of `state` equal to `which` along the last dim, the kept
    indices first in increasing order (the kernels walk keys in order)."""
    hit = state == which
    num = hit.sum(-1, dtype=torch.int32)
    idx = torch.argsort(hit.to(torch.int8), dim=-1, descending=True, stable=True)
    return num.contiguous(), idx.to(torch.int32).contiguous()


class BlockMask:
    """A block-level attention mask (see the module's doc). Build one with from_dense,
    from_mask or from_flex; pass it as flashtune.attention(..., block_mask=...)."""

    __slots__ = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
                 "block_size", "seq_lengths", "mask", "state", "_identity", "_fits")

    def __init__(self, state: torch.Tensor, seq_lengths: tuple, block_size=DEFAULT_BLOCK_SIZE,
                 mask: torch.Tensor | None = None):
        """state: (Bm, Hm, NQB, NKB) int8, 0 dropped, 1 partial, 2 full; Bm, Hm are 1 or the
        call's batch / heads. mask: the element mask of the partial blocks (or None: partial
        blocks are kept in full)."""
        bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        for b in bs:
            if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
                raise ValueError(f"block_mask block_size must be powers of two >= 16, got "
                                 f"{block_size!r}")
        if not isinstance(state, torch.Tensor) or state.dim() != 4:
            raise ValueError("block_mask state must be a 4-D tensor (batch|1, heads|1, query "
                             "blocks, key blocks)")
        nq, nk = (int(n) for n in seq_lengths)
        if state.shape[2:] != (_cdiv(nq, bs[0]), _cdiv(nk, bs[1])):
            raise ValueError(f"block_mask has {tuple(state.shape[2:])} blocks but seq_lengths "
                             f"{(nq, nk)} at block_size {bs} need "
                             f"{(_cdiv(nq, bs[0]), _cdiv(nk, bs[1]))}")
        state = state.to(torch.int8)
        if mask is None:
            state = torch.where(state == PARTIAL, FULL, state).to(torch.int8)
        else:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError("block_mask's element mask must be a bool tensor broadcastable "
                                "to (batch, heads, seqlen_q, seqlen_k)")
            while mask.dim() < 4:
                mask = mask.unsqueeze(0)
            if mask.shape[2:] != (nq, nk) or mask.dim() != 4:
                raise ValueError(f"block_mask's element mask has shape {tuple(mask.shape)}; "
                                 f"expected (batch|1, heads|1, {nq}, {nk})")
        self.state = state.contiguous()
        self.block_size = bs
        self.seq_lengths = (nq, nk)
        self.mask = mask
        self.kv_num_blocks, self.kv_indices = _lists(state, PARTIAL)
        self.full_kv_num_blocks, self.full_kv_indices = _lists(state, FULL)
        st = state.transpose(-1, -2)
        self.q_num_blocks, self.q_indices = _lists(st, PARTIAL)
        self.full_q_num_blocks, self.full_q_indices = _lists(st, FULL)
        self._identity = self._fits = None

    # -- the registered op's flat form ----------------------------------------------------------
    def op_args(self) -> tuple:
        """The tensors and ints torch.library ops take for this mask (from_op_args inverts)."""
        return (self.state, self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                self.full_kv_indices, self.q_num_blocks, self.q_indices, self.full_q_num_blocks,
                self.full_q_indices, self.mask, self.block_size[0], self.block_size[1],
                self.seq_lengths[0], self.seq_lengths[1])

    @classmethod
    def from_op_args(cls, state, kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx,
                     full_q_num, full_q_idx, mask, bs_q: int, bs_kv: int, nq: int, nk: int
                     ) -> "BlockMask":
        """op_args() back into a BlockMask, without recomputing the lists."""
        self = object.__new__(cls)
        self.state, self.mask = state, mask
        self.kv_num_blocks, self.kv_indices = kv_num, kv_idx
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num, full_kv_idx
        self.q_num_blocks, self.q_indices = q_num, q_idx
        self.full_q_num_blocks, self.full_q_indices = full_q_num, full_q_idx
        self.block_size, self.seq_lengths = (bs_q, bs_kv), (nq, nk)
        self._identity = self._fits = None
        return self

    @property
    def identity(self) -> tuple:
        """What a launch plan built for this mask depends on: its tensors' storage (a plan holds
        them, so no other tensor takes those addresses while it lives) and its sizes. Equal for
        the same mask passed again, or rebuilt from the same tensors (the registered op)."""
        ident = self._identity
        if ident is None:  # its tensors are fixed at construction: computed once
            m = self.mask
            ident = self._identity = (
                self.state.data_ptr(), self.kv_indices.data_ptr(), self.q_indices.data_ptr(),
                tuple(self.state.shape), self.block_size, self.seq_lengths,
                None if m is None else (m.data_ptr(), tuple(m.shape), m.stride()))
        return ident

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, blocks: torch.Tensor, seq_lengths: tuple,
                   block_size=DEFAULT_BLOCK_SIZE, mask: torch.Tensor | None = None) -> "BlockMask":
        """blocks: bool (NQB, NKB), (H|1, NQB, NKB) or (B|1, H|1, NQB, NKB), True = compute
        this block. With an element mask, a kept block the mask fills is full, one it partly
        fills is partial, one it leaves empty is dropped."""
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool:
            raise TypeError("block_mask blocks must be a bool tensor (..., query blocks, key "
                            "blocks)")
        while blocks.dim() < 4:
            blocks = blocks.unsqueeze(0)
        state = blocks.to(torch.int8) * FULL
        if mask is not None:
            m = cls._block_states(mask, seq_lengths, block_size)
            state = torch.where(blocks, m, torch.zeros_like(m))
        return cls(state, seq_lengths, block_size, mask)

    @classmethod
    def from_mask(cls, mask: torch.Tensor, block_size=DEFAULT_BLOCK_SIZE) -> "BlockMask":
        """From an element mask, bool (Nq, Nk), (H|1, Nq, Nk) or (B|1, H|1, Nq, Nk): blocks it
        leaves empty are dropped, blocks it fills are full, the rest partial (masked by it)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError("block_mask mask must be a bool tensor (..., seqlen_q, seqlen_k)")
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        seq = tuple(mask.shape[2:])
        return cls(cls._block_states(mask, seq, block_size), seq, block_size, mask)

    @staticmethod
    def _block_states(mask, seq_lengths, block_size) -> torch.Tensor:
        bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        nq, nk = seq_lengths
        if tuple(mask.shape[2:]) != (nq, nk):
            raise ValueError(f"block_mask's element mask has shape {tuple(mask.shape)}; "
                             f"expected (..., {nq}, {nk})")
        pq, pk = _cdiv(nq, bq) * bq - nq, _cdiv(nk, bk) * bk - nk
        m = mask.to(torch.int32)
        # pad the tails as "kept": a tail block's state follows its real elements
        full = torch.nn.functional.pad(m, (0, pk, 0, pq), value=1)
        anyk = torch.nn.functional.pad(m, (0, pk, 0, pq), value=0)
        shape = (*m.shape[:2], full.shape[2] // bq, bq, full.shape[3] // bk, bk)
        all_ = full.reshape(shape).amin(dim=(3, 5)) == 1
        some = anyk.reshape(shape).amax(dim=(3, 5)) == 1
        return torch.where(all_, FULL, torch.where(some, PARTIAL, DROPPED)).to(torch.int8)

    @classmethod
    def from_flex(cls, block_mask, mask: torch.Tensor | None = None) -> "BlockMask":
        """From FlexAttention's BlockMask (torch.nn.attention.flex_attention.create_block_mask):
        the same kept and full blocks at its BLOCK_SIZE. Its partial blocks need their element
        mask: `mask` (bool, broadcastable to (B, H, Nq, Nk)), else its mask_mod is evaluated once
        here into one (create_mask: Nq x Nk booleans per batch|1 x head|1 of the block mask)."""
        for attr in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths"):
            if not hasattr(block_mask, attr):
                raise TypeError(f"block_mask must be a FlexAttention BlockMask (it has no "
                                f"{attr!r}), got {type(block_mask).__name__}")
        nq, nk = (int(n) for n in block_mask.seq_lengths)
        bs = tuple(int(b) for b in block_mask.BLOCK_SIZE)
        nqb, nkb = _cdiv(nq, bs[0]), _cdiv(nk, bs[1])

        def scatter(num, idx, value, state):
            if num is None:
                return state
            num, idx = num[..., :nqb], idx[..., :nqb, :]
            keep = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
            # dropped list entries point at block 0 with value 0: scatter_reduce takes the max
            idx = idx.to(torch.int64).clamp(0, nkb - 1)
            src = keep.to(torch.int8) * value
            return state.scatter_reduce(-1, idx, src, reduce="amax", include_self=True)

        b, h = block_mask.kv_num_blocks.shape[:2]
        state = torch.zeros(b, h, nqb, nkb, dtype=torch.int8, device=block_mask.kv_indices.device)
        state = scatter(block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL, state)
        state = scatter(getattr(block_mask, "full_kv_num_blocks", None),
                        getattr(block_mask, "full_kv_indices", None), FULL, state)
        if mask is None and bool((state == PARTIAL).any()):
            mod = getattr(block_mask, "mask_mod", None)
            if mod is None or getattr(mod, "__name__", "") == "noop_mask":
                state = torch.where(state == PARTIAL, FULL, state).to(torch.int8)
            else:
                from torch.nn.attention.flex_attention import create_mask
                mask = create_mask(mod, b, h, nq, nk, device=state.device)
        return cls(state, (nq, nk), bs, mask)

    # -- views -----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(self.state.shape)

    @property
    def device(self) -> torch.device:
        return self.state.device

    def density(self) -> float:
        """Fraction of the blocks computed (full or partial)."""
        return float((self.state != DROPPED).float().mean())

    def to_dense_mask(self) -> torch.Tensor:
        """The element mask it means, bool (Bm', Hm', Nq, Nk): kept blocks, and in partial ones
        the element mask (the float64 reference and SDPA peers take this)."""
        nq, nk = self.seq_lengths
        bq, bk = self.block_size
        kept = self.state.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :nq, :nk]
        out = kept == FULL
        if self.mask is not None:
            out = out | ((kept == PARTIAL) & self.mask)
        return out

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"seq_lengths={self.seq_lengths}, density={self.density():.3f}, "
                f"element_mask={self.mask is not None})")

    # -- validation against a call -----------------------------------------------------------------
    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raise naming block_mask unless it fits q (B, H, Nq, D), k (B, Hk, Nk, D). Shapes and
        devices only (no value is read: no device->host copy); the last call that fit is
        remembered, so a repeated call checks one tuple."""
        b, h, nq, _ = q.shape
        nk = k.shape[2]
        fits = (b, h, nq, nk, q.device)
        if fits == self._fits:
            return
        if self.seq_lengths != (nq, nk):
            raise ValueError(f"block_mask was built for seq_lengths {self.seq_lengths}, but q, k "
                             f"have ({nq}, {nk})")
        bm, hm = self.state.shape[:2]
        if bm not in (1, b) or hm not in (1, h):
            raise ValueError(f"block_mask has (batch, heads) = ({bm}, {hm}); expected 1 or {b} "
                             f"and 1 or {h}")
        if self.state.device != q.device:
            raise ValueError(f"block_mask is on {self.state.device} but q is on {q.device}")
        if self.mask is not None:
            mb, mh = self.mask.shape[:2]
            if mb not in (1, b) or mh not in (1, h):
                raise ValueError(f"block_mask's element mask has shape {tuple(self.mask.shape)};"
                                 f" expected (1 or {b}, 1 or {h}, {nq}, {nk})")
            if self.mask.device != q.device:
                raise ValueError(f"block_mask's element mask is on {self.mask.device} but q is "
                                 f"on {q.device}")
        self._fits = fits
