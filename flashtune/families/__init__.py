"""The kernel family registry: one entry per schedule of the attention computation.

A family's whole story lives in its module here (flashtune/families/<name>.py): template, the
Variant fields it uses and their rules, defaults, search space, feasibility model, bucket rule,
how it is launched, measured and compiled without a GPU, and whether it can run here. The
dispatcher, the search, `kernels list/show/check` and the CLI iterate this registry; adding a
family is its own files plus one line in _MODULES.

The registry is light (no Triton, no torch at import): the heavy parts of a family are named as
"module:attribute" and imported when first used, so codegen and the CLI can read it cheaply.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["Family", "get", "names", "all_families"]

# the families, in the order the CLI lists them
_MODULES = ("fwd", "bwd", "splitkv", "hopper_fwd", "hopper_bwd")


def _resolve(ref: str):
    mod, _, attr = ref.partition(":")
    return getattr(importlib.import_module(mod), attr)


@dataclass(frozen=True)
class Family:
    name: str
    doc: str                        # one line for `kernels list`
    template: str                   # codegen/templates/<template>
    kernels: tuple                  # the @triton.jit entry points the family launches
    fields: tuple                   # Variant fields beyond block_m/n, num_warps/stages it uses
    defaults: str                   # "module:fn": fn(head_dim, dtype, *, arch=None, **kw) -> Variant
    measure: str                    # "module:OBJ": how the search gates and times it (measure.py)
    compile_check: str              # "module:fn": kernels compiled for a target without a GPU
    feasibility: str = ""           # "module:fn": (kernel, Resources) per kernel; "" = none
    feasibility_version: int = 0    # part of a space's hash: a new model starts new studies
    flops_factor: float = 1.0       # of the forward's FLOPs (bwd: 2.5, DESIGN's convention)
    # how a call's speed is judged: "TFLOP/s" (FLOPs, DESIGN's convention) or "GB/s" (bytes
    # moved, decoding: K and V read once), with `work` the amount per call ("" = FLOPs)
    unit: str = "TFLOP/s"
    work: str = ""
    bucket: str = "flashtune.problem:dense_bucket"  # "module:fn": Problem -> Bucket
    # "module:fn": (family, dtype, head_dim, causal, seqlens, batches) -> the problems a search
    # tunes (empty seqlens/batches: the family's own grid)
    grid: str = "flashtune.search_plan:standard_grid"
    # the head dims a search tunes unless told (the bench's standard grid is D 64, 128, 256; the
    # decode grid takes 64 and 128)
    head_dims: tuple = (64, 128, 256)
    # other families' problems this one can also compute (splitkv: dense forwards), with the
    # launch plan for them ("module:Class", built like launch.FwdPlan from (q, k, v, causal, scale,
    # variant); its run() takes the served call's tensors: fwd (q, k, v), bwd (dout, q, k, v, o,
    # lse) -> what that family's launcher returns) and, until tuned records
    # decide, a measured heuristic ("module:fn": Problem -> bool, True = prefer this family)
    serves: tuple = ()
    serve_plan: str = ""
    # the masks beyond causal (Masks.structure names: window, softcap, block_sparse) its kernels
    # take for those served calls: serve_plan then takes the call's Masks last, and
    # dispatch.mask_twin renders them in; a served call with others runs the served family's
    # default (its own calls take those among `fields`)
    serve_masks: tuple = ()
    # fields only those served calls use: its own calls cannot carry them, so its own problems
    # (and the search's buckets of them) never do (splitkv: block_sparse -- a kvcache call
    # takes no block mask)
    serve_only: tuple = ()
    # "module:fn": (variant, BlockMask) -> (tile changes, "") fitting its variants to a block
    # mask's block size, or ({}, why) where they cannot (dispatch.mask_twin then runs the call's
    # family default); "" = the generic rule in dispatch.mask_twin (BLOCK_M | BS_Q,
    # BLOCK_N | BS_KV, the element mask's tile limit)
    fit_block_mask: str = ""
    # "module:fn": (variant, Masks) -> the field changes a masked render needs beyond the masks
    # and the tiles (hopper_bwd: dq="gluon"'s dQ kernel walks no block mask); "" = none
    mask_changes: str = ""
    # "module:fn": (BlockMask, Nq, GROUP, paged) -> why a served call's plan cannot walk the
    # block mask ("" = it can): that plan then runs the served family's default, and explain()
    # says why (splitkv: a tile's rows must share one list row)
    block_mask_blocker: str = ""
    heuristic: str = ""
    # "module:fn": (q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale, variant, masks) -> the
    # launch plan of a packed variable-length call (q (total_q, H, D), k (total_k, Hk, D)) whose
    # run(dout, q, k, v, o, lse, (cu_seqlens_q, cu_seqlens_k)) computes it; "" = the family has
    # no varlen render (a family serving another's calls then leaves their varlen calls to it)
    varlen_plan: str = ""
    interpreter: bool = True        # runs in Triton's interpreter (CPU tests)
    min_capability: int = 80        # sm_XX the template needs
    max_capability: int = 0         # newest sm_XX it runs on (0: any; Hopper's wgmma: 90 only)
    # "module:fn": Problem -> why the kernels cannot compute it ("" = they can): head dims,
    # dtypes, Triton features. Arch and interpreter are cannot_run's, from the fields above.
    support: str = ""
    rules: tuple = field(default=())  # (field, allowed values, why) per own field with a rule
    # "module:fn": variant -> why its fields do not fit together ("" = they do), beyond `rules`
    # (hopper_bwd: the dQ kernel's tiles only beside that kernel)
    check: str = ""
    seeds: str = ""                 # "module:fn": more variants a search measures first
    # "module:fn": variant -> variants measured first beside a shipped table's winner for the
    # bucket (search.table_winners): the winner with a field added since it was searched
    winner_twins: str = ""
    # "module:fn": (variant, record's bucket, asked bucket) -> (variant, note): a tuned record's
    # variant fitted to a bucket it was not measured on (the nearest-bucket fallback); "" = as is
    adapt: str = ""

    def throughput(self, problem, ms: float) -> float:
        """Speed of one call of `problem` taking `ms`, in self.unit."""
        return self.work_of(problem) / (ms * 1e-3) / _SCALE[self.unit]

    def work_of(self, problem) -> float:
        """FLOPs (TFLOP/s families) or bytes (GB/s) of one call of `problem`."""
        return _resolve(self.work)(problem) if self.work else problem.flops()

    def grid_of(self, dtype: str, head_dim: int, causal: bool, seqlens=(), batches=()) -> list:
        return _resolve(self.grid)(self.name, dtype, head_dim, causal, seqlens, batches)

    def bucket_of(self, problem):
        return _resolve(self.bucket)(problem)

    def estimate_ms(self, problem, record) -> float:
        """How long `problem` takes by the speed a tuned record measured (in record.unit)."""
        return self.work_of(problem) / (record.throughput * _SCALE[record.unit]) * 1e3

    def prefers(self, problem) -> bool:
        return bool(self.heuristic) and _resolve(self.heuristic)(problem)

    def cannot_run(self, problem, arch: str | None) -> str:
        """Why this family cannot serve `problem` on `arch` ("sm_90"; "" or None: no GPU known)
        in this process ("" when it can), or cannot render its masks (mask_fields). The
        dispatcher skips a rival family that cannot run, and explain() quotes the reason."""
        from .. import env
        if not self.interpreter and env.interpreting():
            return "Triton's interpreter is on (TRITON_INTERPRET=1), which cannot run its kernels"
        if self.min_capability > 80 or self.max_capability:
            if not arch:
                return f"no GPU known to be sm_{self.min_capability}"
            cap = int("".join(c for c in arch[3:] if c.isdigit()) or 0)
            top = self.max_capability or cap
            if not self.min_capability <= cap <= top:
                need = (f"sm_{self.min_capability}" if top == self.min_capability else
                        f"sm_{self.min_capability}+")
                return f"the GPU is {arch}; its kernels need {need}"
        lacks = [m for m in problem.mask_kinds if m not in self.mask_fields(problem.family)]
        if lacks:
            return f"its kernels take no {' or '.join(lacks)} mask for {problem.family} calls"
        return _resolve(self.support)(problem) if self.support else ""

    def mask_fields(self, family: str) -> tuple:
        """The masks its variants can render for a call of `family` (its own or a served one)."""
        if family == self.name:
            return tuple(f for f in self.fields if f not in self.serve_only)
        return self.serve_masks

    def blocks_mask(self, block_mask, nq: int, group: int, paged: bool) -> str:
        """Why this family's plan runs a served call's default for `block_mask` ("" if not)."""
        if block_mask is None or not self.block_mask_blocker:
            return ""
        return _resolve(self.block_mask_blocker)(block_mask, nq, group, paged)

    def masked_changes(self, variant, kinds: tuple) -> dict:
        """Field changes `variant` needs to render the masks named in `kinds` ("window",
        "softcap", "block_sparse": Problem.mask_kinds) (mask_changes), beyond masks and tiles."""
        return _resolve(self.mask_changes)(variant, kinds) if self.mask_changes else {}

    def fit_tiles(self, variant, block_mask) -> tuple:
        """(tile changes, why not) of `variant` for a block mask (fit_block_mask)."""
        return _resolve(self.fit_block_mask)(variant, block_mask)

    def adapt_to(self, variant, measured_on, asked):
        """(variant, note) to run for bucket `asked` from a record measured on another bucket."""
        return _resolve(self.adapt)(variant, measured_on, asked) if self.adapt else (variant, "")

    def plan_for(self, q, k, v, causal, scale, variant, masks=None):
        """A launch plan of `variant` for a call of a family this one serves; masks (a Masks
        with some, of serve_masks' kinds) only where the call has them: a dense call's plan is
        built as it always was."""
        extra = (masks,) if masks is not None and masks.any else ()
        return _resolve(self.serve_plan)(q, k, v, causal, scale, variant, *extra)

    def varlen_plan_for(self, q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale, variant,
                        masks):
        """The launch plan of `variant` for a packed variable-length call (varlen_plan)."""
        if not self.varlen_plan:
            raise ValueError(f"{variant.name}: the {self.name} family has no varlen kernels")
        return _resolve(self.varlen_plan)(q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale,
                                          variant, masks)

    def default(self, head_dim: int, dtype: str, **kw):
        return _resolve(self.defaults)(head_dim, dtype, **kw)

    def seed_variants(self, head_dim: int, dtype: str, **kw) -> list:
        """Variants a search measures first (good points for TPE): the default, then seeds."""
        first = [self.default(head_dim, dtype, **kw)]
        if self.seeds:
            first += _resolve(self.seeds)(head_dim, dtype, **kw)
        return list(dict.fromkeys(first))

    def twins_of(self, variant) -> list:
        """The variants a search measures beside a table winner `variant` (winner_twins)."""
        return list(_resolve(self.winner_twins)(variant)) if self.winner_twins else []

    @property
    def ops(self):
        return _resolve(self.measure)

    def resources(self, variant, problem, target) -> tuple:
        return _resolve(self.feasibility)(variant, problem, target) if self.feasibility else ()

    def check_compile(self, variant, head_dim, dtype, causal, tails, capability, usage) -> dict:
        return _resolve(self.compile_check)(variant, head_dim, dtype, causal, tails,
                                            capability, usage)

    def check_variant(self, variant) -> None:
        """Fields other families own must keep their defaults; own fields their allowed values."""
        import dataclasses
        own = set(self.fields) | _CORE
        for f in dataclasses.fields(variant):
            if f.name not in own and getattr(variant, f.name) != f.default:
                raise ValueError(f"Variant.{f.name}={getattr(variant, f.name)!r} does not fit "
                                 f"family {self.name!r} (which uses {sorted(self.fields)})")
        for name, allowed, why in self.rules:
            if getattr(variant, name) not in allowed:
                raise ValueError(f"Variant.{name}={getattr(variant, name)!r} does not fit family "
                                 f"{self.name!r}: {why}")
        why = _resolve(self.check)(variant) if self.check else ""
        if why:
            raise ValueError(f"Variant {variant.name} does not fit family {self.name!r}: {why}")


_CORE = {"family", "block_m", "block_n", "num_warps", "num_stages"}
_SCALE = {"TFLOP/s": 1e12, "GB/s": 1e9}


@lru_cache(maxsize=None)
def _registry() -> dict:
    return {n: importlib.import_module(f"{__name__}.{n}").FAMILY for n in _MODULES}


def names() -> tuple:
    return _MODULES


def all_families() -> list:
    return list(_registry().values())


def get(name: str) -> Family:
    fam = _registry().get(name)
    if fam is None:
        raise KeyError(f"unknown kernel family {name!r}; known: {', '.join(_MODULES)}")
    return fam
