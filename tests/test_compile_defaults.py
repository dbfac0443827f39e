"""The built-in defaults are per architecture: each compiles for its target without register
spills, within shared memory, and without a feature the target lacks (descriptor loads need
Hopper's TMA). `kernels check` runs in its own process with the real JIT (TRITON_INTERPRET=0):
this test process imported Triton in interpreter mode. No GPU needed."""
import json

import pytest

from flashtune import defaults, targets
from flashtune.codegen import Variant
from flashtune.families import all_families
from test_compile_sm90 import kernels_check

_DIMS = (64, 128, 256)
_DTYPES = ("bfloat16", "float16", "float32")


def _all_defaults(arch):
    for dt in _DTYPES:
        for d in _DIMS:
            for fam in all_families():  # each family's default(s): bwd has one per dQ scheme
                yield from fam.seed_variants(d, dt, arch=arch)


def test_no_descriptor_loads_without_tma():
    for arch in ("sm_80", "sm_86", "sm_89", None):
        assert all(v.loads == "pointer" for v in _all_defaults(arch)), arch
    # the sm_90 table keeps its measured TMA forward
    assert defaults.default_variant("fwd", 128, "bfloat16", arch="sm_90").loads == "descriptor"
    assert defaults.table_arch("sm_90a") == "sm_90" and defaults.table_arch("sm_89") == "sm_80"


def test_default_arch_follows_the_gpu_present(monkeypatch):
    defaults.present_arch.cache_clear()
    monkeypatch.setattr(targets, "detect", lambda: targets.get("A100"))
    try:
        assert defaults.default_variant("fwd", 128, "bfloat16") == \
            defaults.default_variant("fwd", 128, "bfloat16", arch="sm_80")
    finally:
        defaults.present_arch.cache_clear()


def _check(gpu, dtypes, dims, *extra):
    r = kernels_check("--gpu", gpu, "--dtype", dtypes, "--head-dim", dims, "--format", "json",
                      *extra)
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    bad = [f"{x['dtype']} D={x['head_dim']} {x['variant']} {x['kernel']}: {x['why']}"
           for x in rows if x["why"]]
    assert r.returncode == 0 and not bad, "\n".join(bad) or r.stdout[-2000:] + r.stderr[-2000:]
    assert "FP fusion" not in r.stderr  # Triton's 3.9 default-change warning stays silent
    return rows


@pytest.mark.parametrize("gpu", ["A100", "H100"])
def test_defaults_spill_free_bf16(gpu):
    rows = _check(gpu, "bf16", "64,128,256")
    t = targets.get(gpu)
    cap = t.capability[0] * 10 + t.capability[1]
    assert {(r["head_dim"], r["variant"]) for r in rows} == {
        (d, v.name) for d in _DIMS for fam in all_families()
        if fam.min_capability <= cap <= (fam.max_capability or cap)  # hopper_*: sm_90 only
        and _takes(fam, d)
        for v in fam.seed_variants(d, "bfloat16", arch=t.arch)}  # every family's defaults


def _takes(fam, d) -> bool:
    """Whether the family's kernels take head dim d (a family whose support() refuses it has no
    row for it)."""
    from flashtune.families import _resolve
    from flashtune.problem import Problem
    p = Problem("bwd", "bfloat16", d, False, 1, 1, 1, 128, 128)
    return not fam.support or "head dim" not in _resolve(fam.support)(p)


# float32 at D=256 is left out: its PRECISE preprocess needs more shared memory than any target
# has, whatever the variant (flashtune/launch_bwd.py), and no tile found avoids spills there.
@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["A100", "H100"])
@pytest.mark.parametrize("causal", ["--causal", "--no-causal"])
def test_defaults_spill_free_all(gpu, causal):
    _check(gpu, "fp16", "64,128,256", causal)
    _check(gpu, "bf16,fp32", "64,128", causal)
    if causal == "--no-causal":
        _check(gpu, "bf16", "256", causal)


@pytest.mark.slow
def test_sm80_forward_and_default_backward_spill_free_with_tails():
    # the tails specialisation (ragged seqlens, GQA): the atomic dK/dV spills there on sm_80 and
    # the sm_90 D >= 128 tiles do too (see flashtune/defaults.py); the default scheme must not
    for d in _DIMS:
        names = [defaults.default_variant(f, d, "bfloat16", arch="sm_80").name
                 for f in ("fwd", "bwd")]
        _check("A100", "bf16", str(d), "--tails", *names)


def test_check_rejects_descriptors_without_tma_and_spills():
    r = kernels_check("--gpu", "A100", "--head-dim", "128", "--format", "json",
                      Variant("fwd", 128, 64, 4, 2, loads="descriptor").name)
    assert r.returncode == 1
    (row,) = json.loads(r.stdout)
    assert any("TMA" in w for w in row["why"]) and any("spills" in w for w in row["why"])
