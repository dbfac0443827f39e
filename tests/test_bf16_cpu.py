"""bfloat16 forward and backward against the float64 reference on whatever device runs the
suite: in Triton's interpreter (where bfloat16 tl.dot is wrong, so the interpreter renders compute
on float32 tiles) and on the GPU. Also: a TRITON_INTERPRET set after Triton's import is an error."""
import os
import subprocess
import sys

import pytest
import torch

from flashtune.codegen import Variant, kernel_hash, render

from _check import assert_matches_reference, qkv
from test_backward import assert_grads_match

BF16 = torch.bfloat16


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,d", [(1, 1, 16), (37, 45, 64), (113, 70, 128), (17, 33, 96)])
def test_forward_bf16(nq, nk, d, causal, device):
    assert_matches_reference(*qkv(1, 4, 2, nq, nk, d, BF16, device), causal=causal)


@pytest.mark.parametrize("loads", ["pointer", "descriptor"])
def test_forward_bf16_loads(loads, device):
    import flashtune
    with flashtune.force(f"fwd-m32-n16-w4-s1-loads={loads}".replace("-loads=pointer", "")):
        assert_matches_reference(*qkv(1, 2, 1, 50, 70, 64, BF16, device), causal=True)


@pytest.mark.parametrize("scheme", ["bwd-m16-n32-w4-s1-dq=atomic",
                                    "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_bf16(scheme, causal, device):
    import flashtune
    with flashtune.force(scheme):
        assert_grads_match(*qkv(1, 4, 2, 45, 71, 64, BF16, device), causal=causal)


def test_interpreter_workaround_is_not_in_gpu_kernels():
    # the GPU render carries no trace of the interpreter's float32 tiles: same code, same hash
    for name in ("fwd-m64-n32-w4-s2", "fwd-m128-n64-w4-s2-loads=descriptor",
                 "bwd-m16-n32-w4-s1-dq=atomic", "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1"):
        v = Variant.parse(name)
        gpu, cpu = render(v), render(v, interpret=True)
        assert "_interp_tile" not in gpu and "float32" in cpu and gpu != cpu
        assert len(gpu.splitlines()) == len(cpu.splitlines())  # line numbers still match
        assert kernel_hash(v) == kernel_hash(v)  # stable


def test_interpret_set_after_import_is_a_clear_error():
    # flashtune.attention imports the kernels (and Triton); `import flashtune` alone does not,
    # so the variable set between the two still reaches Triton (no error, and right)
    code = ("import os, torch, flashtune\n"
            "attention = flashtune.attention\n"
            "q = torch.randn(1, 1, 8, 16)\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "try:\n"
            "    attention(q, q, q)\n"
            "except RuntimeError as e:\n"
            "    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert "ERR" in out.stdout, out.stdout + out.stderr
    assert "before importing flashtune" in out.stdout and "TRITON_INTERPRET=1" in out.stdout
