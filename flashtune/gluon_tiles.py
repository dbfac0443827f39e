"""Tile coordinates of hopper_fwd's bnhd render (Variant.bnhd), imported by the generated
modules: the render's descriptors view q, k, v and O in (B, N, H, D) memory -- a transformers
model's projections viewed as (B, H, N, D), or slices of one fused QKV projection -- as
(B, N, H*D) (launch_hopper.tile_view), so a tile of head h of batch b at query row r sits at
[b, r, h * D]. TMA clips each dim on its own: a tile past a sequence's end reads zeros and
stores nothing, as in the dense (B*H, N, D) view."""
from __future__ import annotations

from .gluon_compat import available

__all__ = ["tile_at"]

if available():
    from triton.experimental.gluon import jit as _jit
    from triton.experimental.gluon import language as gl

    @_jit
    def tile_at(desc, at, row):
        """Coordinates of the tile at `row` of (batch, head) `at` = batch << 16 | head (the
        render packs them so: a division in the loader warp's 24-56 registers spilled; the
        plan keeps B and H under 65,536)."""
        D: gl.constexpr = desc.block_type.shape[2]
        return at >> 16, row, (at & 0xFFFF) * D
