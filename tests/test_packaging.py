"""A plain (non-editable) install carries the whole namespace: templates, spaces, tables, migrations."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True)
    return next(out.glob("flashtune-*.whl"))


def test_wheel_is_one_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "flashtune/codegen/templates/attn_fwd.py.tmpl" in names
    assert "flashtune/search_spaces/fwd.json" in names
    assert any(n.startswith("flashtune/tuned_db/") for n in names)
    # nothing installs a top-level module called codegen, search_spaces or tuned_db
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"flashtune"}, tops


def test_installed_wheel_runs(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    code = ("import torch, flashtune, flashtune.codegen as c; "
            "print(flashtune.__file__); print(c.render(c.Variant.parse('fwd-m64-n32-w4-s2'))[:30]); "
            "q = torch.randn(1, 1, 5, 16); print(flashtune.attention(q, q, q).shape)")
    env = {**os.environ, "PYTHONPATH": str(target), "TRITON_INTERPRET": "1",
           "FLASHTUNE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, check=True)
    assert str(target) in r.stdout and "# flashtune generator" in r.stdout
    assert "torch.Size([1, 1, 5, 16])" in r.stdout
