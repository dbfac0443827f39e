"""flashtune as a Hugging Face transformers attention implementation, against the model's own
"sdpa" on a tiny randomly initialised Llama-style model (GQA 4:2, no download). float32 on every
device, so both implementations are exact to rounding; the tolerance floor is derived from
how far "sdpa" and "eager" themselves differ on the same input."""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtune.integrations.transformers as ft_hf  # noqa: E402

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           max_position_embeddings=64, attention_dropout=0.0)


@pytest.fixture(scope="module")
def name():
    return ft_hf.register()


def _model(device, **over):
    torch.manual_seed(1234)
    cfg = transformers.LlamaConfig(**{**CFG, **over})
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def _run(model, impl, **inputs):
    model.set_attn_implementation(impl)
    return model(**inputs)


def _assert_close(got, want, other, what):
    """|got - want| within 1e-4 of want's range, or 4x the sdpa-vs-eager gap `other`."""
    err = (got - want).abs().max().item()
    tol = max(1e-4 * want.abs().max().item(), 4 * other, 1e-6)
    assert err <= tol, f"{what}: max |err| {err:.3g} > tol {tol:.3g}"


def test_name_is_not_taken_for_flash_attention_or_a_hub_kernel(name):
    assert name == ft_hf.NAME == "ft_attention"
    assert "flash" not in name.lower()
    from transformers.utils.generic import is_flash_attention_requested
    assert not is_flash_attention_requested(requested_attention_implementation=name)
    try:
        from transformers.integrations.hub_kernels import is_kernel
    except ImportError:  # moved in some release: the name has no "/" anyway
        pass
    else:
        assert not is_kernel(name)
    for bad in ("flashtune", "my_flash", "org/repo", "sdpa_ft", "paged|ft"):
        with pytest.raises(ValueError, match="name"):
            ft_hf.register(bad)


def test_register_is_idempotent(name):
    assert ft_hf.register() == name
    assert ft_hf.register() == name
    assert transformers.AttentionInterface._global_mapping[name] is ft_hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping[name] is ft_hf.padding_mask


def test_flashtune_import_does_not_import_transformers():
    code = ("import sys, flashtune, flashtune.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_transformers_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    with pytest.raises(ImportError, match="pip install transformers"):
        ft_hf.register()


def test_logits_loss_and_gradients_match_sdpa(name, device):
    model = _model(device)
    ids = torch.randint(0, CFG["vocab_size"], (2, 12), device=device)
    results = {}
    for impl in ("eager", "sdpa", name):
        model.zero_grad(set_to_none=True)
        out = _run(model, impl, input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results[impl] = (out.logits.detach(), out.loss.detach(), grads)
    (le, se, ge), (ls, ss, gs), (lf, sf, gf) = results["eager"], results["sdpa"], results[name]
    _assert_close(lf, ls, (le - ls).abs().max().item(), "logits")
    _assert_close(sf, ss, (se - ss).abs().item(), "loss")
    assert gf.keys() == gs.keys()
    for n in gs:
        _assert_close(gf[n], gs[n], (ge[n] - gs[n]).abs().max().item(), f"grad {n}")


def _padded_batch(device):
    ids = torch.randint(1, CFG["vocab_size"], (3, 12), device=device)
    mask = torch.ones(3, 12, dtype=torch.long, device=device)
    mask[0, :4] = 0    # left padding
    mask[1, -5:] = 0   # right padding
    return ids, mask   # row 2: none


def test_padded_batch_matches_sdpa_at_real_tokens(name, device):
    model = _model(device)
    ids, mask = _padded_batch(device)
    real = mask.bool()
    with torch.no_grad():
        le = _run(model, "eager", input_ids=ids, attention_mask=mask).logits[real]
        ls = _run(model, "sdpa", input_ids=ids, attention_mask=mask).logits[real]
        lf = _run(model, name, input_ids=ids, attention_mask=mask).logits[real]
    _assert_close(lf, ls, (le - ls).abs().max().item(), "logits at real tokens")


def test_pad_tokens_are_not_attended(name, device, monkeypatch):
    import flashtune
    calls = {"attention": 0, "attention_varlen": 0}
    for fn in calls:
        def spy(*a, _fn=getattr(flashtune, fn), _name=fn, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(flashtune, fn, spy)
    model = _model(device)
    ids, mask = _padded_batch(device)
    real = mask.bool()
    other = torch.where(real, ids, (ids * 7 + 3) % CFG["vocab_size"])  # new ids at pads only
    assert (other != ids).any()
    model.set_attn_implementation(name)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits[real]
        b = model(input_ids=other, attention_mask=mask).logits[real]
    assert torch.equal(a, b)
    # a padded batch runs packed (attention_varlen), never dense over the padding
    assert calls == {"attention": 0, "attention_varlen": 2 * CFG["num_hidden_layers"]}


def test_packed_sequences_from_position_ids_match_sdpa(name, device):
    # one row holding three sequences (positions restart), no padding mask: as
    # DataCollatorWithFlattening feeds training; sdpa builds a block-causal mask for it when
    # there is no cache (use_cache=False; with a cache it attends across them, and
    # flash_attention_2 and flashtune do not)
    model = _model(device)
    ids = torch.randint(0, CFG["vocab_size"], (1, 12), device=device)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]], device=device)
    with torch.no_grad():
        kw = dict(input_ids=ids, position_ids=pos, use_cache=False)
        ls = _run(model, "sdpa", **kw).logits
        lf = _run(model, name, **kw).logits
        le = _run(model, "eager", **kw).logits
        # and they really are separate: the third sequence alone gives the same logits
        alone = _run(model, name, input_ids=ids[:, 8:], position_ids=pos[:, 8:]).logits
    _assert_close(lf, ls, (le - ls).abs().max().item(), "packed logits")
    _assert_close(lf[:, 8:], alone, (le - ls).abs().max().item(), "third sequence alone")


def _generate(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              pad_token_id=0, **kw)


def _assert_same_or_a_tie(model, name, got, want, mask):
    """Greedy tokens agree; where they first differ, sdpa's own top two logits there must be
    closer than the two implementations' logits differ (a tie any exact kernel may break either
    way: random-init models have many)."""
    if torch.equal(got, want):
        return
    b, t = (int(x) for x in (got != want).nonzero()[0])
    full = torch.cat([mask, torch.ones(mask.shape[0], got.shape[1] - mask.shape[1],
                                       dtype=mask.dtype, device=mask.device)], 1)
    prefix, pmask = want[b:b + 1, :t], full[b:b + 1, :t]
    logits = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=prefix, attention_mask=pmask).logits[0, -1].double()
    top = logits["sdpa"].topk(2).values
    err = (logits[name] - logits["sdpa"]).abs().max().item()
    assert (top[0] - top[1]).item() <= 2 * err, (
        f"greedy tokens differ at sequence {b}, step {t} without a tie: top-2 gap "
        f"{(top[0] - top[1]).item():.3g}, logits differ by {err:.3g}\n{got.tolist()}\n"
        f"{want.tolist()}")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_matches_sdpa(name, device, cache):
    model = _model(device)
    ids = torch.randint(1, CFG["vocab_size"], (2, 8), device=device)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # a left-padded prompt beside a full one
    kw = {} if cache == "dynamic" else {"cache_implementation": "static"}
    want = _generate(model, "sdpa", ids, mask, **kw)
    got = _generate(model, name, ids, mask, **kw)
    _assert_same_or_a_tie(model, name, got, want, mask)
    if cache == "static":  # no padding: transformers drops the mask, the cache has empty slots
        got = _generate(model, name, ids[1:], None, **kw)
        want = _generate(model, "sdpa", ids[1:], None, **kw)
        _assert_same_or_a_tie(model, name, got, want, torch.ones_like(ids[1:]))


def test_dropout_is_a_clear_error(name, device):
    model = _model(device, attention_dropout=0.1).train()
    model.set_attn_implementation(name)
    ids = torch.randint(0, CFG["vocab_size"], (1, 6), device=device)
    with pytest.raises(ValueError, match="no attention dropout"):
        model(input_ids=ids)
    model.eval()  # transformers passes dropout=0.0 in eval mode
    model(input_ids=ids)


def test_unsupported_arguments_are_clear_errors(device):
    module = torch.nn.Module()
    q = torch.randn(1, 4, 5, 16, device=device)
    k = v = torch.randn(1, 2, 5, 16, device=device)
    with pytest.raises(NotImplementedError, match="4D"):
        ft_hf.attention_forward(module, q, k, v, torch.zeros(1, 1, 5, 5, device=device))


@pytest.mark.parametrize("padded", [False, True])
def test_sliding_window_and_softcap(padded, device):
    # transformers' FlashAttention-2 meaning: sliding_window W = window (W - 1, W - 1), causal
    from flashtune.reference import reference
    module = torch.nn.Module()
    q = torch.randn(2, 4, 20, 16, device=device)
    k, v = torch.randn(2, 2, 20, 16, device=device), torch.randn(2, 2, 20, 16, device=device)
    mask = None
    if padded:
        mask = torch.ones(2, 20, dtype=torch.bool, device=device)
        mask[1, :5] = False  # left padding
    out, _ = ft_hf.attention_forward(module, q, k, v, mask, sliding_window=6, softcap=3.0,
                                     is_causal=True)
    kw = dict(causal=True, window=(5, 5), softcap=3.0)
    ref0 = reference(q[:1], k[:1], v[:1], **kw)
    torch.testing.assert_close(out[:1].transpose(1, 2).double(), ref0, atol=2e-5, rtol=1e-4)
    s = 5 if padded else 0
    ref1 = reference(q[1:, :, s:], k[1:, :, s:], v[1:, :, s:], **kw)
    torch.testing.assert_close(out[1:, s:].transpose(1, 2).double(), ref1, atol=2e-5, rtol=1e-4)


def test_gemma2_sliding_window_and_softcap_match_eager(name, device):
    # Gemma 2: alternating sliding-window (4 tokens) and global layers, logit softcapping (a
    # small cap: this tiny model's scores are small, and a cap of 50 would change nothing)
    torch.manual_seed(1234)
    cfg = transformers.Gemma2Config(**{**CFG, "num_hidden_layers": 2}, sliding_window=4,
                                    attn_logit_softcapping=0.05, query_pre_attn_scalar=16)
    model = transformers.Gemma2ForCausalLM(cfg).to(device).eval()
    ids = torch.randint(0, CFG["vocab_size"], (2, 12), device=device)
    want = _run(model, "eager", input_ids=ids).logits.detach()
    got = _run(model, name, input_ids=ids).logits.detach()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
