"""torch.compile(fullgraph=True) traces through flashtune.attention (a torch.library custom op
with a fake implementation and an autograd formula): no graph breaks, same values as eager."""
import pytest
import torch

import flashtune


class TinyAttention(torch.nn.Module):
    """One attention layer in (batch, seqlen, heads, head_dim) layout, GQA, causal."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.d).unbind(2)
        y = flashtune.attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


def _run(model, x):
    x = x.detach().requires_grad_()
    out = model(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad]
    model.zero_grad()
    return out.detach().clone(), grads


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend, device):
    torch._dynamo.reset()
    model = TinyAttention().to(device)
    x = torch.randn(2, 37, 64, device=device)
    ref_out, ref_grads = _run(model, x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out, grads = _run(compiled, x)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_compiled_graph_holds_the_custom_ops(device):
    torch._dynamo.reset()
    seen = []

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def aot_backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=backend, bw_compiler=backend)

    model = TinyAttention().to(device)
    _run(torch.compile(model, fullgraph=True, backend=aot_backend),
         torch.randn(1, 20, 64, device=device))
    assert "flashtune.attn_fwd.default" in seen and "flashtune.attn_bwd.default" in seen, seen


@pytest.mark.gpu
def test_gpu_compile_with_cuda_graphs(device):
    torch._dynamo.reset()
    model = TinyAttention(dim=256, heads=4, kv_heads=1).to(device, torch.bfloat16)
    x = torch.randn(2, 512, 256, device=device, dtype=torch.bfloat16)
    ref_out, ref_grads = _run(model, x)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        out, grads = _run(compiled, x)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=5e-2, rtol=5e-2)
