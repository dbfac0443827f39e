"""`Variant`: one kernel the generator can emit -- family + structural choices + tile/launch params."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import hashlib

# Each family (flashtune/families/) has one template in codegen/templates/. Structural fields
# change the rendered text; the rest reach the kernel as constexprs (BLOCK_M, ...) or launch
# knobs (num_warps, num_stages).
LOADS = ("pointer", "descriptor")
DQ_SCHEMES = ("none", "separate", "atomic", "fused", "gluon")

# Short spellings used in variant names: fwd-m128-n64-w8-s3
_ABBREV = {"block_m": "m", "block_n": "n", "num_warps": "w", "num_stages": "s",
           "block_m2": "mq", "block_n2": "nq", "num_warps2": "wq", "num_stages2": "sq",
           "num_splits": "sp", "loader_regs": "lr", "q_buffers": "qb"}
_FROM_ABBREV = {v: k for k, v in _ABBREV.items()}
_ALWAYS = ("family", "block_m", "block_n", "num_warps", "num_stages")  # in every name and dict


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class Variant:
    family: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # structural: split the causal key loop into an unmasked off-diagonal part and a masked
    # diagonal part (False: one loop that masks every block). hopper_fwd: its dense key loop
    # split into an unmasked loop and a masked one (diagonal, key tail), causal or not
    causal_split: bool = True
    # structural: "pointer" (pointer arithmetic + masks) or "descriptor" (tensor descriptors,
    # which lower to TMA on Hopper and zero-fill out-of-bounds reads)
    loads: str = "pointer"
    # bwd only: how dQ is accumulated ("separate": a kernel parallel over query blocks,
    # deterministic; "atomic": float32 atomic adds from the key-block kernel; "fused": the
    # separate scheme's query-block programs in the key-block kernel's launch, deterministic)
    dq: str = "none"
    # bwd only, dq="separate": tiles and launch knobs of the dQ kernel (0 = not used); "fused"
    # takes its tiles (block_m2, block_n2) and shares the launch knobs of the one kernel
    block_m2: int = 0
    block_n2: int = 0
    num_warps2: int = 0
    num_stages2: int = 0
    # bwd only (structural): how the dQ programs (dq="separate" or "fused") read K and V, as
    # `loads` says for the dK/dV programs' Q and dO ("descriptor": TMA on Hopper)
    dq_loads: str = "pointer"
    # splitkv only: programs that share the keys of one (sequence, kv head); 0 = as many as fill
    # the GPU (decided at launch from the SM count and the batch)
    num_splits: int = 0
    # splitkv only (structural, sm_90; not searched: the launch takes this render of a record's
    # variant where the grid is one wave and PDL works, launch_splitkv.SplitKVPlan): the partial
    # kernel is a programmatic dependent launch that sends the first rows of its split's K/V to
    # L2 before it waits for the kernel before it, and lets the next kernel start early
    early_start: bool = False
    # structural: packed variable-length sequences (cu_seqlens) instead of a dense batch
    varlen: bool = False
    # structural, hopper families: a descriptor may view its tensor as (B, N, H*D) -- heads side
    # by side in each row, as a transformers model's q/k/v projections leave them -- beside the
    # (B*H, N, D) view of the (B, H, N, D) layout; not searched: the launchers take this render
    # of a record's variant for calls in that layout (flashtune/gluon_tiles.py)
    bnhd: bool = False
    # structural, splitkv only: the KV cache is paged ((num_pages, page_size, Hk, D) addressed
    # through a block table) instead of one (B, Ncache, Hk, D) tensor
    paged: bool = False
    # structural, splitkv only (sm_90, Gluon): the partial kernel streams K/V through a TMA ring
    # and runs QK^T and PV on wgmma, one tile per (sequence, kv head): block_m 64, the rows in
    # wgmma's M; 16 or 32, S^T = K Q^T and O^T = V^T P^T with the rows in its N (no 64-row padding
    # of a decode step's few rows); contiguous or paged caches, no masks beyond causal
    # (launch_splitkv.gluon_blocker, kvcache.fit_pages; elsewhere the launch runs the same variant
    # without it). Searched where the family takes it (search_spaces/splitkv.json's `when`)
    gluon: bool = False
    # hopper_fwd only (Gluon, sm_90): two consumer partitions with a Q tile each taking turns on
    # the tensor cores (structural); a persistent grid of one program per SM looping over tiles
    # (launch); the loader warp's registers (setmaxnreg; 0 = no loader partition: the consumers
    # load their own K/V ring -- structural -- and other families, which have none)
    pingpong: bool = False
    # hopper_fwd only (structural, with pingpong): a third consumer partition, the turns going
    # round the three (FA3's 192-row tile at D=64)
    three_consumers: bool = False
    persistent: bool = False
    loader_regs: int = 0
    # hopper_fwd only: Q tiles per consumer (each its tile's O staging buffer): 2 lets the loader
    # fetch the next tile's Q and K/V while a persistent program's consumers finish the current one
    q_buffers: int = 1
    # hopper_fwd only (structural): causal tiles ordered in sections of heads whose K/V fit in
    # L2, longest first within a section (the template's _tile_coords)
    l2_order: bool = False
    # hopper_fwd only (structural, causal, not with l2_order): causal tiles head by head, each
    # head's query blocks together and rotated by the head's index (the template's _tile_coords)
    head_order: bool = False
    # hopper_fwd only (structural): a barrier over a consumer's warps before it hands a K/V stage
    # back; false: one thread hands it back right after its wgmma wait (FA3's release)
    release_barrier: bool = True
    # hopper_fwd only (structural): O rescaled between issuing S_j and P_{j-1} V_{j-1} (FA3's
    # order, under S_j's wgmma) instead of after P_{j-1} V_{j-1}'s wait
    early_rescale: bool = False
    # hopper_fwd only (structural): each K/V stage handed back in two halves, K's once S = Q K^T
    # has read it and V's after P V, so the loader refills K a step earlier (FA3's two pipelines)
    early_k_release: bool = False
    # hopper_fwd only (structural, q_buffers=2): a tile's O store waited for under the next
    # tile's first QK^T instead of in its own epilogue
    async_o_store: bool = False
    # hopper_bwd only (structural, dq="none"): dQ's atomics issued while a product runs (dK's;
    # D=256's second dQ chunk under the next step's S^T / dP^T) instead of with none in flight
    dq_overlap: bool = False
    # structural, masks beyond causal (flashtune/masks.py; only the variants that take them carry
    # their code): local attention with runtime (left, right) bounds; tanh softcapping of the
    # scores; block-sparse key iteration over a flashtune.BlockMask's lists
    window: bool = False
    softcap: bool = False
    block_sparse: bool = False

    def __post_init__(self):
        from flashtune.families import get, names
        try:
            family = get(self.family)
        except KeyError:
            raise ValueError(f"Variant.family must be one of {names()}, got {self.family!r}"
                             ) from None
        for f in ("block_m", "block_n", "num_warps"):
            v = getattr(self, f)
            if not isinstance(v, int) or not _pow2(v):
                raise ValueError(f"Variant.{f} must be a power of two, got {v!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"Variant.num_stages must be an int in 1..8, got {self.num_stages!r}")
        if self.loads not in LOADS:
            raise ValueError(f"Variant.loads must be one of {LOADS}, got {self.loads!r}")
        if self.dq_loads not in LOADS:
            raise ValueError(f"Variant.dq_loads must be one of {LOADS}, got {self.dq_loads!r}")
        if self.dq not in DQ_SCHEMES:
            raise ValueError(f"Variant.dq must be one of {DQ_SCHEMES}, got {self.dq!r}")
        for f in ("block_m2", "block_n2", "num_warps2"):
            v = getattr(self, f)
            if v and not _pow2(v):
                raise ValueError(f"Variant.{f} must be 0 or a power of two, got {v!r}")
        if not isinstance(self.loader_regs, int) or self.loader_regs < 0:
            raise ValueError(f"Variant.loader_regs must be an int >= 0, got {self.loader_regs!r}")
        if not isinstance(self.q_buffers, int) or self.q_buffers < 1:
            raise ValueError(f"Variant.q_buffers must be an int >= 1, got {self.q_buffers!r}")
        if not isinstance(self.num_splits, int) or self.num_splits < 0:
            raise ValueError(f"Variant.num_splits must be an int >= 0, got {self.num_splits!r}")
        # which fields a family owns and their rules (bwd's dq, splitkv's num_splits and paged):
        # its flashtune/families/ entry
        family.check_variant(self)

    # -- stable identity -------------------------------------------------------------------
    # Fields at their default are left out of the dict, the JSON and the key: a field added
    # later (with a default that keeps the old kernel) changes no existing variant's key or text.
    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name in _ALWAYS or getattr(self, f.name) != f.default}

    @property
    def key(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown Variant field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    # -- human names: fwd-m128-n64-w8-s3[-loads=descriptor]... -----------------------------------
    @property
    def name(self) -> str:
        parts = [self.family]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "family" or (f.name not in _ALWAYS and v == f.default):
                continue
            if f.name in _ABBREV:
                parts.append(f"{_ABBREV[f.name]}{v}")
            else:
                parts.append(f"{f.name}={str(v).lower() if isinstance(v, bool) else v}")
        return "-".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """Read a variant from its name (fwd-m128-n64-w8-s3) or its JSON."""
        text = text.strip()
        if text.startswith("{"):
            return cls.from_dict(json.loads(text))
        family, *tokens = text.split("-")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {"family": family}
        for tok in tokens:
            if "=" in tok:
                k, v = tok.split("=", 1)
                if k not in fields:
                    raise ValueError(f"variant name {text!r}: unknown field {k!r}")
                if fields[k].type in ("bool", bool):
                    if v not in ("true", "false"):
                        raise ValueError(f"variant name {text!r}: {k} must be true or false")
                    values[k] = v == "true"
                elif fields[k].type in ("int", int):
                    values[k] = int(v)
                else:
                    values[k] = v
                continue
            head = tok.rstrip("0123456789")
            digits = tok[len(head):]
            if head not in _FROM_ABBREV or not digits:
                raise ValueError(f"variant name {text!r}: cannot read {tok!r} "
                                 f"(expected one of {sorted(_FROM_ABBREV)} followed by a number)")
            values[_FROM_ABBREV[head]] = int(digits)
        missing = [f for f in _ALWAYS[1:] if f not in values]
        if missing:
            raise ValueError(f"variant name {text!r} lacks {missing}")
        return cls(**values)

    def structure(self) -> dict:
        """The fields that change the rendered text (the template's `#%if` conditions read these)."""
        return {"causal_split": self.causal_split, "loads": self.loads, "dq": self.dq,
                "dq_loads": self.dq_loads,
                "varlen": self.varlen, "bnhd": self.bnhd, "paged": self.paged,
                "gluon": self.gluon,
                # the gluon render's tile with rows in wgmma's N (block_m 16 or 32)
                "swap_ab": self.gluon and self.block_m < 64,
                "pingpong": self.pingpong, "three_consumers": self.three_consumers,
                "loader": self.loader_regs > 0, "l2_order": self.l2_order,
                "head_order": self.head_order,
                "release_barrier": self.release_barrier, "early_rescale": self.early_rescale,
                "early_k_release": self.early_k_release, "async_o_store": self.async_o_store,
                "dq_overlap": self.dq_overlap, "early_start": self.early_start,
                "window": self.window,
                "softcap": self.softcap, "block_sparse": self.block_sparse,
                # any mask beyond causal: the window's bounds and loops (softcap alone runs them
                # with an unbounded window)
                "masked": self.window or self.softcap or self.block_sparse}

    @property
    def descriptors(self) -> bool:
        """Whether any kernel of the variant reads through tensor descriptors (needs TMA)."""
        return "descriptor" in (self.loads, self.dq_loads)

    @property
    def masks(self) -> tuple:
        """The mask code this variant carries: ("window", "softcap", "block_sparse") or fewer."""
        return tuple(m for m in ("window", "softcap", "block_sparse") if getattr(self, m))
