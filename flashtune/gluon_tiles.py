"""Tile coordinates of the Hopper templates' `bnhd` renders (Variant.bnhd), imported by the
generated modules: a descriptor views its tensor either as (B*H, N, D) -- the (B, H, N, D)
layout, the dense renders' only view -- or as (B, N, H*D) -- heads side by side in each row, as
a transformers model's q/k/v projections leave them (launch_hopper.tma_view picks per tensor).
TMA clips each view's dims on their own, so a tile past a sequence's end reads zeros and
stores nothing in either."""
from __future__ import annotations

from .gluon_compat import available

__all__ = ["tile_at"]

if available():
    from triton.experimental.gluon import jit as _jit
    from triton.experimental.gluon import language as gl

    @_jit
    def tile_at(desc, plane, row):
        """Coordinates of the tile at `row` of (batch, head) plane `plane` = b * heads + h: the
        descriptor's heads are its last dim's width over the tile's (1 for (B*H, N, D))."""
        D: gl.constexpr = desc.block_type.shape[2]
        heads = desc.shape[2] // D
        return plane // heads, row, (plane % heads) * D
