"""The generator: deterministic rendering, structure as variant fields, cache, CLI."""
import json

import pytest
from click.testing import CliRunner

from flashtune.cli import main
from flashtune.codegen import GENERATOR_VERSION, Variant, load, render, source_path
from flashtune.codegen.render import TemplateError, template_text

V = Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2)


def test_same_variant_same_bytes():
    again = Variant.parse(V.name)
    assert again == V and again.key == V.key
    assert render(again) == render(V)


def test_header_names_variant_and_generator():
    first = render(V).splitlines()[0]
    assert V.name in first and GENERATOR_VERSION in first and "attn_fwd.py.tmpl" in first
    assert json.loads(first[first.index("{"):]) == json.loads(V.to_json())


def test_line_numbers_match_template():
    tmpl = template_text("fwd").splitlines()
    for v in (V, Variant.parse("fwd-m64-n32-w4-s2-causal_split=false-loads=descriptor")):
        out = render(v).splitlines()
        assert len(out) == len(tmpl)
        for a, b in zip(out[1:], tmpl[1:]):
            assert a == "" or a == b


@pytest.mark.parametrize("field,value,present,absent", [
    ("loads", "descriptor", "make_tensor_descriptor", "tl.load(k_src"),
    ("causal_split", False, "IS_CAUSAL or not EVEN_N", "full_end, hi, rows"),
])
def test_structural_fields_change_code(field, value, present, absent):
    import dataclasses
    base, other = render(V), render(dataclasses.replace(V, **{field: value}))
    assert present in other and present not in base
    assert absent in base and absent not in other


def test_tile_params_stay_constexpr():
    # BLOCK_M etc. are constexprs: two tile configs differ only in the header line
    a = render(V).splitlines()
    b = render(Variant("fwd", block_m=128, block_n=64, num_warps=8, num_stages=3)).splitlines()
    assert a[1:] == b[1:] and a[0] != b[0]


def test_cache_is_content_addressed(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path))
    p = source_path(V)
    assert p.parent == tmp_path / "kernels" and p.read_text() == render(V)
    assert source_path(V) == p
    assert hasattr(load(V), "attn_fwd")


def test_template_error_points_at_line():
    from flashtune.codegen.render import _eval
    with pytest.raises(TemplateError, match=r"attn_fwd.py.tmpl:7: cannot evaluate"):
        _eval("nonexistent_field", {}, "attn_fwd.py.tmpl:7")


@pytest.mark.parametrize("bad,words", [
    (dict(block_m=48), "block_m must be a power of two"),
    (dict(num_stages=0), "num_stages"),
    (dict(loads="tma"), "loads must be one of"),
    (dict(family="decode"), "family must be one of"),
    (dict(dq="atomic"), "does not fit family 'fwd'"),
])
def test_bad_variants(bad, words):
    import dataclasses
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(V, **bad)


@pytest.mark.parametrize("text,words", [
    ("fwd-m64-x3", "cannot read 'x3'"), ("fwd-m64-n32", "lacks"),
    ("fwd-m64-n32-w4-s2-bogus=1", "unknown field 'bogus'"),
])
def test_bad_variant_names(text, words):
    with pytest.raises(ValueError, match=words):
        Variant.parse(text)


def test_cli_kernels_show_and_list():
    r = CliRunner().invoke(main, ["kernels", "show", V.name])
    assert r.exit_code == 0 and r.output.startswith("# flashtune generator") and "def attn_fwd" in r.output
    r = CliRunner().invoke(main, ["kernels", "show", "fwd-m64-zz"])
    assert r.exit_code != 0 and "VARIANT" in r.output
    r = CliRunner().invoke(main, ["kernels", "list"])
    assert r.exit_code == 0 and "fwd" in r.output and "descriptor" in r.output
    r = CliRunner().invoke(main, ["kernels", "list", "--format", "json"])
    assert any(row["family"] == "fwd" for row in json.loads(r.output))
