"""What a search covers: buckets from the CLI's dtypes x head dims x causal x seqlens x batches,
each with the representative problem that gets timed, and its space on the target. Each family
says how those become problems (its `grid`): the dense families the standard grid, splitkv the
decode grid."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .problem import Bucket, Problem
from .search_space import Space
from .targets import Target

# DESIGN.md's standard grid: B*N = 16k tokens, hidden 2048 (H = 2048 / D)
TOKENS = 16384
HIDDEN = 2048
STANDARD_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def standard_problem(family: str, dtype: str, head_dim: int, causal: bool, seqlen: int,
                     batch: int | None = None, group: int = 1) -> Problem:
    b = batch if batch else max(1, TOKENS // seqlen)
    return with_group(Problem(family, dtype, head_dim, causal, 1, b, HIDDEN // head_dim, seqlen,
                              seqlen), group)


@dataclass(frozen=True)
class PlannedBucket:
    bucket: Bucket
    problem: Problem
    space: Space


def standard_grid(family: str, dtype: str, head_dim: int, causal: bool, seqlens=(),
                  batches=()) -> list[Problem]:
    """DESIGN.md's standard grid: query = key length, B*N = 16k tokens unless batches given."""
    return [standard_problem(family, dtype, head_dim, causal, n, b)
            for n in (seqlens or STANDARD_SEQLENS) for b in (batches or (None,))]


def with_group(p: Problem, group: int) -> Problem:
    """A dense grid problem with `group` q heads per K/V head (GQA; its heads rounded down to a
    multiple, at least one group). The decode grid's problems keep their own (32/8, 8/1)."""
    if group == 1 or p.group != 1:
        return p
    heads = max(group, p.heads)
    return dataclasses.replace(p, group=group, heads=heads - heads % group)


def plan(target: Target, families, dtypes, head_dims, causal, seqlens=(), batches=(),
         masks=((),), groups=(1,)) -> list[PlannedBucket]:
    """One entry per distinct bucket, in the order given (problems that share a bucket are
    tuned once, with the first). Empty head_dims/seqlens/batches: each family's own grid.
    masks: Problem mask fields per mask spec (masks.parse_spec, as (name, value) pairs; () = no
    mask): every grid problem is tuned once per spec its family can take. groups: q heads per
    K/V head of the dense grid's problems (1: MHA, the standard grid; 4: Llama's GQA), each its
    own buckets (Bucket.gqa)."""
    from .families import get
    from .problem import head_dim_bucket
    out: dict[str, PlannedBucket] = {}
    for fam in families:
        grid = get(fam).grid_of
        for dt in dtypes:
            for d in head_dims or get(fam).head_dims:
                for c in causal:
                    # measure the bucket's own head dim: D=96 shares the D=128 bucket (one
                    # BLOCK_D), so asking for 96 tunes exactly what 128 tunes instead of
                    # overwriting its record with other measurements
                    for p0 in (with_group(g0, g) for g0 in grid(dt, head_dim_bucket(d), c,
                                                                  seqlens, batches)
                               for g in groups):
                        for spec in masks:
                            p = dataclasses.replace(p0, **dict(spec))
                            if any(m not in get(fam).mask_fields(fam) for m in p.mask_kinds):
                                continue  # splitkv's own calls take no block mask
                            bk = Bucket.of(p)
                            if bk.key not in out:
                                out[bk.key] = PlannedBucket(bk, p, Space.build(fam, target, p))
    return list(out.values())
