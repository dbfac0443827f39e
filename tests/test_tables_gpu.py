"""The shipped table of the GPU present serves that GPU through the dispatcher (issue 12: an
H200 call is served by the H200 table, not by the H100's). Runs on the device."""
from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune import dispatch, targets
from flashtune.problem import Bucket
from flashtune.search_plan import plan
from tuned_db.io import read_table, table_path

from _check import assert_matches_reference

pytestmark = pytest.mark.gpu


@pytest.fixture
def table(tmp_path, monkeypatch, reset_dispatch):
    """This GPU's shipped table, with no user DB in the way and the dispatcher at its defaults."""
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path / "cache"))
    for knob in ("FLASHTUNE_DB", "FLASHTUNE_GPU"):
        monkeypatch.delenv(knob, raising=False)
    dispatch.configure()
    name = torch.cuda.get_device_name()
    path = table_path(targets.slug_of(name))
    if not path.exists():
        pytest.skip(f"no shipped table for {name}")
    return read_table(path)


def test_every_record_serves_its_bucket_on_this_gpu(table):
    """Each record's bucket, asked for by a problem of the search's plan, is answered from this
    GPU's own table with that record's variant (or by a rival family whose tuned record or
    measured heuristic beat it: then explain says so)."""
    target = targets.detect()
    fams = sorted({r.bucket.family for r in table.records})
    planned = {pb.bucket.key: pb.problem
               for pb in plan(target, fams, ("bfloat16",), (64, 128), (False, True))}
    served = 0
    for r in table.records:
        p = planned.get(r.bucket.key)
        if p is None:  # a bucket off the standard grids (a hand-run search): the plan lacks it
            continue
        assert Bucket.of(p) == r.bucket
        ex = dispatch.explain(p)
        if ex.variant.family != r.variant.family:
            assert any(n.startswith("competed:") for n in ex.notes), (r.bucket.key, ex)
            continue
        assert (ex.level, ex.origin, ex.distance) == ("gpu-table", table.path, 0), (r.bucket, ex)
        assert ex.variant == r.variant and ex.record.bucket == r.bucket
        served += 1
    assert served >= len(table.records) // 2, (served, len(table.records))


def test_a_call_runs_the_tables_variant_and_matches_the_reference(table):
    """A forward call in a tuned bucket (small batch: the bucket keys on batch*heads) runs the
    table's record, computed right."""
    fwd = [r for r in table.records if r.bucket.family == "fwd" and not r.bucket.gqa]
    assert fwd, "the table has fwd records"
    r = min(fwd, key=lambda r: (r.bucket.seqlen_q, r.bucket.head_dim))
    b = r.bucket
    heads = 2048 // b.head_dim
    batch = max(1, b.batch_heads // heads)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, b.seqlen_q, b.head_dim, device="cuda",
                           dtype=torch.bfloat16, generator=g) for _ in range(3))
    ex = flashtune.explain(q, k, v, causal=b.causal)
    assert ex.record is not None and ex.origin == table.path, ex
    assert_matches_reference(q[:1, :2], k[:1, :2], v[:1, :2], causal=b.causal,
                             out=flashtune.attention(q, k, v, causal=b.causal)[:1, :2])


# the shipped variants are checked in PARTS slices (a pytest case each): a step's timeout on the
# device loses one slice, not the rest, and `-k "variant and part3"` runs one (the H100 table's
# 35 hopper_fwd variants x 4 took longer than a 200 s step as one test: session 33)
PARTS = 6


def _each_shipped_variant(table, family: str, shape: tuple, check, part: int) -> None:
    """Every distinct dense `family` variant of this GPU's table in slice `part` of PARTS
    forced on `shape` (B, H, Hk, Nq, Nk), bf16 and fp16, causal and not: check(q, k, v,
    causal=...) against the float64 reference (the search's gate checked each on its own
    bucket's shape only)."""
    from _check import qkv
    names = sorted({(r.bucket.head_dim, r.variant.name) for r in table.records
                    if r.bucket.family == family and not r.variant.masks})
    assert names, f"the table has {family} records"
    for d, name in names[part::PARTS]:
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                q, k, v = qkv(*shape, d, dtype, "cuda")
                with flashtune.force(name):
                    check(q, k, v, causal=causal)


@pytest.mark.parametrize("part", range(PARTS), ids=lambda p: f"part{p}")
def test_each_backward_variant_the_table_ships_matches_the_reference(table, part):
    """The variants serving backward calls (hopper_bwd, dq="gluon" included: session 23's
    records) on odd lengths with GQA: the gradients."""
    from test_backward import assert_grads_match
    _each_shipped_variant(table, "hopper_bwd", (1, 4, 2, 193, 250), assert_grads_match,
                          part)


@pytest.mark.parametrize("part", range(PARTS), ids=lambda p: f"part{p}")
def test_each_forward_variant_the_table_ships_matches_the_reference(table, part):
    """The hopper_fwd variants (three consumers included: session 30's D=64 causal 1k-4k
    records): the output, on 1000 rows (no tile divides them) with GQA 4 and 512 tiles of 128
    rows, so a persistent grid's 132 programs loop over several each."""
    _each_shipped_variant(table, "hopper_fwd", (4, 16, 4, 1000, 1000),
                          assert_matches_reference, part)
