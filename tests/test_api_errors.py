"""Bad input gets a clear error naming the argument and what was expected."""
import pytest
import torch

import flashtune


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


GOOD = dict(q=t(1, 4, 8, 32), k=t(1, 2, 8, 32), v=t(1, 2, 8, 32))


def call(**over):
    args = {**GOOD, **over}
    kw = {k: args.pop(k) for k in ("causal", "scale") if k in args}
    return flashtune.attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("over,exc,words", [
    (dict(q=[1, 2]), TypeError, ["q must be a torch.Tensor", "list"]),
    (dict(k=t(2, 8, 32)), ValueError, ["k must have 4 dims", "(2, 8, 32)"]),
    (dict(q=t(1, 4, 8, 32, dtype=torch.float64)), TypeError, ["q.dtype", "float16, bfloat16 or float32"]),
    (dict(v=t(1, 2, 8, 32, dtype=torch.float32)), TypeError, ["v.dtype", "must match q.dtype"]),
    (dict(k=t(2, 2, 8, 32), v=t(2, 2, 8, 32)), ValueError, ["batch sizes differ"]),
    (dict(v=t(1, 2, 9, 32)), ValueError, ["k and v must have the same shape"]),
    (dict(k=t(1, 2, 8, 64), v=t(1, 2, 8, 64)), ValueError, ["head_dim differs", "q has 32"]),
    (dict(q=t(1, 4, 8, 8), k=t(1, 2, 8, 8), v=t(1, 2, 8, 8)), ValueError, ["head_dim 8", "16..256"]),
    (dict(q=t(1, 4, 8, 320), k=t(1, 2, 8, 320), v=t(1, 2, 8, 320)), ValueError, ["head_dim 320"]),
    (dict(k=t(1, 3, 8, 32), v=t(1, 3, 8, 32)), ValueError, ["q heads (4)", "multiple of k/v heads (3)"]),
    (dict(q=t(1, 4, 32, 8).transpose(2, 3)), ValueError, ["q must have a contiguous last dim"]),
    (dict(causal=1), TypeError, ["causal must be a bool"]),
    (dict(scale="x"), TypeError, ["scale must be a float"]),
    (dict(scale=-1.0), ValueError, ["scale must be a finite positive number"]),
    (dict(scale=float("nan")), ValueError, ["scale must be a finite positive number"]),
])
def test_bad_input(over, exc, words):
    with pytest.raises(exc) as e:
        call(**over)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_cpu_outside_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        call()


@pytest.mark.gpu
def test_mixed_devices():
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        flashtune.attention(GOOD["q"].cuda(), GOOD["k"], GOOD["v"].cuda())
