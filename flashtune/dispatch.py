"""Problem -> Variant: the runtime dispatcher, called on every flashtune.attention.

Lookup order (tuned_db/lookup.py has the rules, nearest bucket and the stale-entry policy):

    forced (force() / FLASHTUNE_FORCE_VARIANT)
    -> user DB (FLASHTUNE_DB, else the SQLite file in the cache folder if it exists)
    -> shipped table of this GPU -> shipped tables of the same architecture
    -> built-in default (defaults.py)

The hot path is a thread-local read, an environment read and one dict lookup keyed by the
Problem: the DB and the tables are read once per process (and again after clear_cache() or a
write to the tuned DB from this process), the GPU is detected once. Nothing here creates a
database file. A bad table or DB is logged once and skipped; it never fails a call.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import env
from ._keys import as_dict
from .codegen import Variant
from .defaults import default_variant
from .problem import Bucket, Problem, dtype_name
from .tuned_db.events import on_write
from .tuned_db.record import Record

__all__ = ["select", "select_for_call", "select_varlen", "pointer_twin", "varlen_twin",
           "varlen_pointer_fallback", "explain", "force", "clear_cache", "configure",
           "builtin_defaults", "Explanation"]

log = logging.getLogger("flashtune.dispatch")

_forced = threading.local()
_MEMO_MAX = 1 << 16           # distinct problems remembered before the memo starts over
_memo: dict = {}              # Problem -> Variant
_memo_call: dict = {}         # (family, dtype, q shape, k heads, Nk, causal) -> Variant (hot path)
_by_bucket: dict = {}         # Bucket -> Explanation (the slow path's result)
_state = None                 # _Levels, read once
_state_lock = threading.Lock()
_warned: set = set()


# -- forcing a config, for debugging ------------------------------------------------------------
class force:
    """Pin `variant` (a Variant, its name or JSON) for every call of this thread: debugging.

        flashtune.force("fwd-m128-n64-w8-s3")          # pinned until force(None)
        with flashtune.force("fwd-m64-n32-w4-s2"):     # pinned for the block, then as before
            ...

    The name is read at once: a bad one raises ValueError here, not at the next call."""
    __slots__ = ("variant", "_prev")

    def __init__(self, variant: Variant | str | None):
        if isinstance(variant, str):
            variant = Variant.parse(variant)
        elif variant is not None and not isinstance(variant, Variant):
            raise TypeError(f"force() takes a Variant, a variant name or JSON, or None; got "
                            f"{type(variant).__name__}")
        self.variant = variant
        self._prev = getattr(_forced, "variant", None)
        _forced.variant = variant

    def __enter__(self) -> Variant | None:
        return self.variant

    def __exit__(self, *exc) -> None:
        _forced.variant = self._prev


@lru_cache(maxsize=8)
def _parse_forced(text: str) -> Variant:
    try:
        return Variant.parse(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"FLASHTUNE_FORCE_VARIANT={text!r} is not a variant: {e}") from None


def _forced_variant() -> tuple[Variant | None, str]:
    v = getattr(_forced, "variant", None)
    if v is not None:
        return v, "force()"
    text = env.forced_variant()
    if text:
        return _parse_forced(text), "FLASHTUNE_FORCE_VARIANT"
    return None, ""


# -- the hot path -------------------------------------------------------------------------------
def _serves(variant: Variant, family: str) -> bool:
    """Whether `variant` can serve a call of `family` (its own, or one its family serves)."""
    from .families import get
    return variant.family == family or family in get(variant.family).serves


def select(problem: Problem) -> Variant:
    forced = forced_variant()
    if forced is not None and _serves(forced, problem.family):
        return forced
    v = _memo.get(problem)
    if v is None:
        v = _select_slow(problem)
    return v


def forced_variant() -> Variant | None:
    """The variant force() or FLASHTUNE_FORCE_VARIANT pins (None: dispatch as usual)."""
    forced = getattr(_forced, "variant", None)
    if forced is None and env.forced_variant():
        forced = _parse_forced(env.forced_variant())
    return forced


def select_for_call(family: str, q, k, causal: bool, masks=None) -> Variant:
    """select() for the tensors of a call. A hit is one tuple and one dict lookup: no Problem
    is built (that dataclass costs more than the rest of the lookup). masks (flashtune/masks.py):
    a masked call looks up its masked bucket; the caller renders the masks in (mask_twin)."""
    forced = forced_variant()
    if forced is not None and _serves(forced, family):
        return forced
    ks = k.shape
    key = (family, q.dtype, q.shape, ks[1], ks[2], causal)
    if masks is not None and masks.any:
        key += masks.key
    v = _memo_call.get(key)
    if v is None:
        v = select(Problem.of_call(family, q, k, causal, masks))
        if len(_memo_call) >= _MEMO_MAX:
            _memo_call.clear()
        _memo_call[key] = v
    return v


def _select_slow(problem: Problem) -> Variant:
    v = _compete(problem).variant
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()  # a stream of distinct shapes: the per-bucket results stay, refill is cheap
    _memo[problem] = v
    return v


def _compete(problem: Problem, varlen: bool = False) -> "Explanation":
    """Families compete for a problem: `problem.family`'s own answer, or that of a family that
    also serves it (splitkv serves dense forwards), whichever the tuned records say is faster
    for this problem; without records for both, the rival family's measured heuristic.
    varlen: for packed sequences, among the rivals with varlen kernels whose answer has a
    varlen render (the dense records' times stand for them)."""
    from .families import all_families, get
    ex = _explain_bucket(problem)
    for rival in all_families():
        if problem.family not in rival.serves or (varlen and not rival.varlen_plan):
            continue
        why_not = rival.cannot_run(problem, _levels().arch)
        if why_not:  # silently the problem's own family; explain() says why
            ex = dataclasses.replace(ex, notes=ex.notes + (f"{rival.name} skipped: {why_not}",))
            continue
        rp = dataclasses.replace(problem, family=rival.name)
        rex = _explain_bucket(rp)
        if varlen:
            try:
                varlen_twin(rex.variant)
            except ValueError as e:  # a schedule its varlen render lacks (hopper_bwd dq_overlap)
                ex = dataclasses.replace(ex, notes=ex.notes + (f"{rival.name} skipped: {e}",))
                continue
        # records compete only for their own shape: one octaves away, scaled to this problem's
        # work, says nothing (an Nq~512 fwd record "ran" a decode step in 1.5 us on the H100);
        # a masked bucket's nearest records of the same shape (another window or density, the
        # dense one) do compete, scaled by the keys computed (a 50%-dense block mask at 16k ran
        # the generic fwd's dense record by the heuristic, 0.6x the Hopper one)
        if (ex.record is not None and rex.record is not None and _comparable(ex, rex)
                and _runs_as_timed(problem, ex) and _runs_as_timed(rp, rex)):
            # one search timed both on the problem's own bucket: that run's pair decides
            same = (same_run(ex.record, rex.record) if ex.record.bucket == ex.bucket
                    and rex.record.bucket == rex.bucket else None)
            if same is not None:
                mine, theirs, date = same
                why = (f"{rival.name} {rex.variant.name} {theirs:.3g} ms vs {problem.family} "
                       f"{ex.variant.name} {mine:.3g} ms (timed in one run, {date[:10]})")
            else:
                mine = get(problem.family).estimate_ms(problem, ex.record)
                theirs = rival.estimate_ms(rp, rex.record)
                why = (f"{rival.name} {rex.variant.name} ~{theirs:.3g} ms vs {problem.family} "
                       f"{ex.variant.name} ~{mine:.3g} ms (tuned records)")
            better = theirs < mine
        else:
            better = rival.prefers(problem)
            why = f"{rival.name} {rex.variant.name} preferred by its heuristic" if better else ""
        winner = rex if better else ex
        if why:
            ex = dataclasses.replace(winner, problem=problem,
                                     notes=winner.notes + (f"competed: {why}",))
    return ex


def same_run(mine: Record, theirs: Record) -> tuple | None:
    """(my variant's ms, their variant's ms, the run's date) from the newest search that timed
    both records' variants side by side (a search's final re-timing takes the other families'
    records of its bucket as runner-ups: search.rival_variants); None where no run did. Two
    records' own medians come from different runs, often sessions and machines apart."""
    pairs = []
    t = mine.ms_of(theirs.variant.name)
    if t is not None:
        pairs.append((mine.provenance.date, mine.median_ms, t))
    t = theirs.ms_of(mine.variant.name)
    if t is not None:
        pairs.append((theirs.provenance.date, t, theirs.median_ms))
    if not pairs:
        return None
    date, a, b = max(pairs)
    return a, b, date


def _runs_as_timed(problem: Problem, ex: "Explanation") -> bool:
    """Whether the call runs what ex's record timed, masks apart: a family whose masked twin
    changes the schedule (hopper_bwd: a block-masked call of a dq="gluon" record adds dQ by
    atomics) ran something else, and its time says nothing about the twin (session 24: such a
    record's twin served the 16k block-mask bucket at 0.69x the generic bwd)."""
    from .families import get
    return not get(ex.variant.family).masked_changes(ex.variant, problem.mask_kinds)


def _same_shape(ex: "Explanation", gqa: bool = True) -> bool:
    """Whether ex's record was measured on the problem's own bucket, masks apart (gqa=False:
    and whether K/V were shared by query heads apart)."""
    if ex.distance == 0:
        return True
    a, b = ex.bucket, ex.record.bucket
    return (a.seqlen_q, a.seqlen_k, a.batch_heads, a.gqa or not gqa) == (
        b.seqlen_q, b.seqlen_k, b.batch_heads, b.gqa or not gqa)


def _comparable(ex: "Explanation", rex: "Explanation") -> bool:
    """Whether two families' records may decide between them: each measured on the problem's
    own bucket; or, for a GQA call, both on its shape without GQA (the tables tune the standard
    grid, whose heads are not shared: a GQA call -- Llama, Mistral, Qwen -- found no record of
    its own in any family, and the rivals' heuristics gave every such call on the H100 to the
    generic kernels; every family reads the K/V a group shares in place alike)."""
    if _same_shape(ex) and _same_shape(rex):
        return True
    return (_same_shape(ex, gqa=False) and _same_shape(rex, gqa=False)
            and ex.record.bucket.gqa == rex.record.bucket.gqa)


@lru_cache(maxsize=256)
def pointer_twin(variant: Variant) -> Variant:
    """The pointer-load twin of a descriptor variant, for inputs TMA cannot address."""
    return dataclasses.replace(variant, loads="pointer", dq_loads="pointer")


def mask_twin(variant: Variant, masks, head_dim: int, dtype, family: str | None = None
              ) -> Variant:
    """`variant` rendered with the mask code `masks` needs (window, softcap, block_sparse), its
    tiles fitted to a block mask's block size (BLOCK_M | BS_Q, BLOCK_N | BS_KV), for a call of
    `family` (None: the variant's own). A variant whose family cannot render the masks for that
    call (Family.mask_fields: a family's serve_masks for the calls it serves) or fit its tiles to the
    block mask (Family.fit_block_mask: hopper_fwd's ping-pong tile over 64-row query blocks)
    gives way to the built-in default of the call's family."""
    family = family or variant.family
    twin, _ = mask_fit(variant, masks, family)
    if twin is None:
        twin, _ = mask_fit(default_variant(family, head_dim, dtype_name(dtype)), masks, family)
    return twin


def mask_fit(variant: Variant, masks, family: str) -> tuple:
    """(`variant` with the masks rendered in and its tiles fitted, "") or (None, why its family
    cannot, for a call of `family`): mask_twin's rule, and explain()'s reason."""
    from .families import get
    fam = get(variant.family)
    want = masks.structure
    takes = fam.mask_fields(family)
    lacks = [name for name, on in want.items() if on and name not in takes]
    if lacks:
        return None, f"{variant.family} renders no {' or '.join(lacks)} mask for {family} calls"
    bm = masks.block_mask
    tiles = {}
    if bm is not None and fam.fit_block_mask:
        tiles, why = fam.fit_tiles(variant, bm)
        if why:
            return None, f"{variant.family} cannot fit its tiles to the block mask: {why}"
    elif bm is not None:
        bq, bk = bm.block_size
        tiles = dict(block_m=min(variant.block_m, bq), block_n=min(variant.block_n, bk))
        if variant.block_m2:
            tiles.update(block_m2=min(variant.block_m2, bq), block_n2=min(variant.block_n2, bk))
        if bm.mask is not None:
            # partial blocks load a [rows, keys] tile of the element mask (a pointer per
            # element): at most 16 per thread. sm_90, D=128 bf16 (`kernels check`, 2026-11-23):
            # fwd m128-n64-w8 spills 632 B with it, m128-n32-w8 and m64-n32-w4 none
            def fit(loop_dim, other, warps):
                return min(loop_dim, max(16, 512 * warps // other))
            if variant.family == "bwd":  # dK/dV walks queries (block_m); dQ walks keys
                tiles["block_m"] = fit(tiles["block_m"], tiles["block_n"], variant.num_warps)
                if variant.block_m2:  # (dq="fused": the one kernel's warps)
                    tiles["block_n2"] = fit(tiles["block_n2"], tiles["block_m2"],
                                            variant.num_warps2 or variant.num_warps)
            else:
                tiles["block_n"] = fit(tiles["block_n"], tiles["block_m"], variant.num_warps)
    changes = {**want, **tiles, **fam.masked_changes(variant, masks.kinds)}
    return _twin(variant, tuple(sorted(changes.items()))), ""


@lru_cache(maxsize=1024)
def _twin(variant: Variant, changes: tuple) -> Variant:
    return dataclasses.replace(variant, **dict(changes))


@lru_cache(maxsize=256)
def varlen_twin(variant: Variant) -> Variant:
    """The same tiles and loads rendered for packed variable-length sequences."""
    return dataclasses.replace(variant, varlen=True)


def select_varlen(family: str, q, k, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                  causal: bool, masks=None) -> Variant:
    """select() for a varlen call on packed q (total_q, H, D), k (total_k, Hk, D): the variant of
    the dense problem with `batch` sequences of the longest lengths (what the grid covers), made
    varlen (a forced variant too). Families serving `family`'s calls compete where they have
    varlen kernels (Family.varlen_plan: hopper_bwd's backward; splitkv and hopper_fwd have
    none), for calls without masks beyond causal (their varlen renders take none)."""
    from .families import get
    total_q, h, d = q.shape
    plain = masks is None or not masks.any
    forced = forced_variant()
    if forced is not None and (forced.family == family or (
            plain and _serves(forced, family) and get(forced.family).varlen_plan)):
        try:
            return varlen_twin(forced)
        except ValueError:  # a schedule the family's varlen render lacks: dispatched instead
            pass
    problem = Problem(family, dtype_name(q.dtype), d, causal, h // k.shape[1], batch, h,
                      max_seqlen_q, max_seqlen_k)
    return _explain_varlen(problem, plain).variant


def _explain_varlen(problem: Problem, plain: bool) -> "Explanation":
    """What a packed variable-length call of `problem`'s shape runs (made varlen): the rivals
    with varlen kernels compete for a call without masks beyond causal (`plain`); a masked one
    keeps the family's own answer (the rivals' varlen renders take no masks)."""
    ex = _compete(problem, varlen=True) if plain else _explain_bucket(problem)
    return dataclasses.replace(ex, problem=problem, variant=varlen_twin(ex.variant))


def varlen_pointer_fallback(family: str, head_dim: int, dtype: str) -> Variant:
    """For packed tensors TMA cannot address (a base or row stride not 16-byte aligned): the
    portable pointer-load default, not the tuned TMA variant's pointer twin, which says nothing
    about its speed (D=128's m128-n64-w4-s2 twin spills 300 B on sm_90, compile report
    2026-11-23, and ran the causal varlen forward at 0.52x the dense one on the H100)."""
    return varlen_twin(default_variant(family, head_dim, dtype, arch="sm_80"))


# -- explain ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Explanation:
    """Which bucket, which record and which level of the lookup order served a problem."""
    problem: Problem
    bucket: Bucket
    variant: Variant
    level: str                 # "forced" | "user-db" | "gpu-table" | "arch-table" | "default"
    origin: str                # DB URL, table file, "flashtune/defaults.py", "force()", ...
    gpu: str | None            # GPU slug the tables were chosen for (None: no GPU)
    record: Record | None = None
    distance: float = 0.0      # octaves from the problem's bucket to the record's (0: exact)
    stale: tuple = ()          # why the record is stale: its template changed (empty: fresh)
    notes: tuple = ()          # the record's neutral facts (measured with another Triton), then
    #                            what each level said: missing tables, errors, skipped records

    def to_dict(self) -> dict:
        return {
            "problem": as_dict(self.problem),
            "bucket": as_dict(self.bucket),
            "variant": self.variant.name,
            "level": self.level,
            "origin": self.origin,
            "gpu": self.gpu,
            "record": None if self.record is None else {
                "bucket": dataclasses.asdict(self.record.bucket),
                "median_ms": self.record.median_ms, "throughput": self.record.throughput,
                "unit": self.record.unit, "source": self.record.provenance.source,
                "date": self.record.provenance.date},
            "distance": self.distance,
            "stale": list(self.stale),
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        b = self.bucket
        lines = [f"problem  {_fmt_problem(self.problem)}",
                 f"bucket   {b.family} {b.dtype} d{b.head_dim} causal={b.causal} gqa={b.gqa} "
                 f"Nq~{b.seqlen_q} Nk~{b.seqlen_k} BH~{b.batch_heads}"
                 + (f" mask={b.mask}" if b.mask else ""),
                 f"gpu      {self.gpu or '(none detected)'}",
                 f"level    {self.level}  ({self.origin})",
                 f"variant  {self.variant.name}"]
        if self.record is not None:
            r, rb = self.record, self.record.bucket
            where = "exact bucket" if self.distance == 0 else (
                f"nearest bucket Nq~{rb.seqlen_q} Nk~{rb.seqlen_k} BH~{rb.batch_heads} "
                f"gqa={rb.gqa}, {self.distance:g} octaves away")
            lines.append(f"record   {where}: {r.median_ms:.4g} ms, {r.throughput:.4g} {r.unit}, "
                         f"source {r.provenance.source}, {r.provenance.date}")
        lines += [f"stale    {s}" for s in self.stale]
        lines += [f"note     {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt_problem(p: Problem) -> str:
    masks = "".join(f" {n}={v}" for n, v in (("window", p.window), ("softcap", p.softcap),
                                              ("block_density", p.block_density)) if v)
    return (f"{p.family} {p.dtype} d{p.head_dim} causal={p.causal} group={p.group} "
            f"B={p.batch} H={p.heads} Nq={p.seqlen_q} Nk={p.seqlen_k}{masks}")


def explain(problem, k=None, v=None, *, causal: bool = False, family: str = "fwd",
            window=None, softcap=None, block_mask=None, varlen: bool = False) -> Explanation:
    """Why `problem` runs the variant it runs. Takes a Problem, or the tensors of a call:
    explain(q, k, v, causal=True, window=(256, 0)) (also flashtune.explain). For a masked call
    (the masks given, or a Problem's mask fields, then with the search's representative masks)
    `variant` is the one that runs: the chosen variant with the masks rendered in
    (mask_twin), and a note says which it was chosen as. varlen (a Problem only): what an
    attention_varlen call with `batch` sequences of the problem's lengths (the longest) runs."""
    from .masks import NONE, Masks, check_softcap, check_window, representative
    if not isinstance(problem, Problem):
        masks = Masks(check_window(window, causal, problem.shape[-2], k.shape[-2]),
                      check_softcap(softcap), block_mask)
        problem = Problem.of_call(family, problem, k, causal, masks)
    else:
        masks = representative(problem, "cpu") if problem.mask_kinds else NONE
    forced, origin = _forced_variant()
    if forced is not None and _serves(forced, problem.family):
        from .families import get
        why_not = get(forced.family).cannot_run(problem, _levels().arch)
        notes = ()
        if why_not and forced.family != problem.family:
            notes = (f"{forced.family} cannot run here ({why_not}): its plan runs the generic "
                     f"{problem.family} default instead",)
        ex = Explanation(problem, Bucket.of(problem), forced, "forced", origin, _levels().gpu,
                         notes=notes)
    elif varlen:
        ex = _explain_varlen(problem, not masks.any)
    else:
        ex = dataclasses.replace(_compete(problem), problem=problem)
    return _masks_rendered(ex, masks)


def _masks_rendered(ex: Explanation, masks) -> Explanation:
    """`ex` naming the variant a masked call runs: the chosen one's mask twin."""
    if not masks.any:
        return ex
    from .problem import torch_dtype
    p = ex.problem
    ran = mask_twin(ex.variant, masks, p.head_dim, torch_dtype(p.dtype), p.family)
    _, why = mask_fit(ex.variant, masks, p.family)
    from .families import get
    if not why:
        note = f"runs {ran.name}: {ex.variant.name} with the call's masks rendered in"
        changed = {f: v for f, v in get(ex.variant.family).masked_changes(ex.variant, masks.kinds)
                   .items() if getattr(ex.variant, f) != v}
        if changed:  # e.g. hopper_bwd's dQ kernel walks no block mask: dQ by atomics
            note += (" and " + ", ".join(f"{f}={v!r}" for f, v in changed.items())
                     + " (what its family renders masks with)")
    else:
        note = f"runs {ran.name}: {why}, so the {p.family} default with the masks"
    blocked = get(ran.family).blocks_mask(masks.block_mask, p.seqlen_q, p.group, ran.paged)
    if blocked and ran.family != p.family:
        note += (f"; its plan runs the {p.family} default with the masks instead: {blocked}")
    return dataclasses.replace(ex, variant=ran, notes=ex.notes + (note,))


# -- the slow path: read the levels once, choose per bucket ---------------------------------------
@dataclass(frozen=True)
class _Overrides:
    gpu: str | None = None         # "H100", a device name or a slug; "" means: no GPU
    db: str | None = None          # a SQLAlchemy URL instead of FLASHTUNE_DB / the default file
    tables_dir: str | None = None  # instead of the shipped tuned_db/tables
    tuned: bool = True             # False: no user DB, no tables -- the built-in defaults only


_over = _Overrides()


def configure(*, gpu: str | None = None, db: str | None = None,
              tables_dir: str | Path | None = None, tuned: bool = True) -> None:
    """Point the dispatcher at another GPU, user DB or tables folder (tests, the CLI's --gpu,
    --db and --tables); tuned=False skips the DB and the tables (the built-in defaults, with
    the families' heuristics). configure() with no arguments restores the defaults. Clears the
    memo."""
    global _over
    _over = _Overrides(gpu, db, None if tables_dir is None else str(tables_dir), tuned)
    clear_cache()


class builtin_defaults:
    """Within the block, dispatch as if no tuned DB or table existed: what a fresh install
    runs (`flashtune bench` times it beside the tuned dispatch). Other overrides stay."""

    def __enter__(self):
        global _over
        self._prev = _over
        _over = dataclasses.replace(_over, tuned=False)
        clear_cache()

    def __exit__(self, *exc) -> None:
        global _over
        _over = self._prev
        clear_cache()


_clear_hooks: list = []


def on_clear(fn) -> None:
    """Call fn() whenever the lookups are forgotten (memos built on top of select, e.g. the
    launch plans in ops.py)."""
    _clear_hooks.append(fn)


def clear_cache() -> None:
    """Forget every lookup: the next call of each problem reads the DB and the tables again."""
    global _state
    with _state_lock:
        _memo.clear()
        _memo_call.clear()
        _by_bucket.clear()
        _state = None
        for fn in _clear_hooks:
            fn()


on_write(clear_cache)  # this process wrote the tuned DB (search, import): re-read it


@dataclass(frozen=True)
class _Levels:
    gpu: str | None
    sources: tuple
    notes: tuple
    arch: str = ""  # the GPU's ("sm_90"); "" unknown: the defaults then follow the GPU present


def _gpu() -> tuple[str | None, str]:
    """(slug, arch) of the GPU to tune for: the override, FLASHTUNE_GPU, else the detected one."""
    from .tuned_db.gpu import gpu_slug, target_of
    name = _over.gpu if _over.gpu is not None else env.gpu_override()
    if name == "":
        return None, ""
    if name:
        t = target_of(name)
        return (t.slug, t.arch) if t else (gpu_slug(name), "")
    from . import targets
    try:
        t = targets.detect()
    except Exception as e:  # noqa: BLE001 -- a broken driver must not fail attention
        log.warning("flashtune: GPU detection failed (%s); using the built-in defaults", e)
        return None, ""
    return (t.slug, t.arch) if t else (None, "")


def _read_levels() -> _Levels:
    from .tuned_db import lookup
    from .tuned_db.io import TABLES_DIR
    gpu, arch = _gpu()
    if gpu is None:
        return _Levels(None, (), ("no GPU detected (set FLASHTUNE_GPU to use a tuned table)",))
    if not _over.tuned:
        return _Levels(gpu, (), ("tuned records off (built-in defaults only)",), arch)
    tables = Path(_over.tables_dir) if _over.tables_dir else TABLES_DIR
    url = _over.db or env.db_url()
    default = env.cache_dir() / "tuned.db"
    sources = [lookup.user_db(gpu, url, f"sqlite:///{default}", default.exists())]
    own, table_arch = lookup.gpu_table(gpu, tables)
    sources.append(own)
    sources += lookup.arch_tables(gpu, arch or table_arch, tables)
    for s in sources:
        for e in s.errors:
            log.warning("flashtune: %s", e)
    notes = tuple(n for s in sources for n in s.notes + s.errors)
    return _Levels(gpu, tuple(s for s in sources if s.records), notes, arch or table_arch or "")


def _levels() -> _Levels:
    global _state
    st = _state
    if st is None:
        with _state_lock:
            st = _state
            if st is None:
                try:
                    st = _read_levels()
                except Exception as e:  # noqa: BLE001 -- never fail attention over a table
                    log.warning("flashtune: reading the tuned tables failed (%r); using the "
                                "built-in defaults", e)
                    st = _Levels(None, (), (f"reading the tuned tables failed: {e!r}",))
                _state = st
    return st


def _explain_bucket(problem: Problem) -> Explanation:
    bucket = Bucket.of(problem)
    ex = _by_bucket.get(bucket)
    if ex is not None:
        return ex
    levels = _levels()
    match = None
    try:
        from .tuned_db.lookup import best
        match = best(bucket, levels.sources)
    except Exception as e:  # noqa: BLE001
        log.warning("flashtune: tuned lookup failed for %s (%r); using the built-in default",
                    bucket, e)
    if match is None:
        ex = Explanation(problem, bucket,
                         default_variant(problem.family, problem.head_dim, problem.dtype,
                                         arch=levels.arch or None),
                         "default", "flashtune/defaults.py", levels.gpu, notes=levels.notes)
    else:
        if match.stale:  # only a changed template: another Triton is a note, not a warning
            _warn_once((match.origin, match.record.natural_key),
                       f"flashtune: using stale tuned record {match.record.variant.name} for "
                       f"{bucket} from {match.origin} ({'; '.join(match.stale)}): no fresh record "
                       "serves it; re-run `flashtune search` to refresh")
        variant, note = match.record.variant, ""
        if match.distance:  # a neighbour's record: fitted to this bucket by its family
            from .families import get as family
            variant, note = family(variant.family).adapt_to(variant, match.record.bucket, bucket)
        ex = Explanation(problem, bucket, variant, match.level, match.origin,
                         levels.gpu, match.record, match.distance, match.stale,
                         match.notes + levels.notes + ((note,) if note else ()))
    _by_bucket[bucket] = ex
    return ex


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)
