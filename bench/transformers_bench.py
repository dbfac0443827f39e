"""A Llama-style transformers model on flashtune ("ft_attention") beside its own "sdpa".

    python3 bench/transformers_bench.py --out transformers.json     # H100: ~1-2 min
    TRITON_INTERPRET=1 python3 bench/transformers_bench.py --tiny --device cpu --out t.json  # smoke

Model (random init, no download): hidden 2048, 16 heads, 4 kv heads (GQA 4:1), head_dim 128,
4 layers, MLP 5632, vocab 32000, bf16 on CUDA.
  train     one training step, forward + backward (loss over the logits, no optimizer), batch
            8 x 2048 tokens, causal, no padding; tokens/s = 8*2048 / step time.
  generate  model.generate(greedy, batch 8, prompt 512, exactly 128 new tokens, DynamicCache);
            tokens/s = 8*128 / wall time (prefill included).
The implementations alternate within each repeat (after a warmup that compiles flashtune's
kernels), and medians are reported: compare them as ratios from one run. A check row gives
the logits' difference between the two (bf16) and how many greedy tokens agree. JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import flashtune.integrations.transformers as ft_hf  # noqa: E402

FULL = dict(model=dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=128, num_hidden_layers=4, intermediate_size=5632,
                       vocab_size=32000, max_position_embeddings=4096),
            train=(8, 2048), gen=(8, 512, 128))
TINY = dict(model=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_hidden_layers=2, intermediate_size=128, vocab_size=128,
                       max_position_embeddings=64),
            train=(2, 16), gen=(2, 8, 4))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def environment(device) -> dict:
    import transformers
    import triton
    env = {"torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--repeats", type=int, default=5, help="timed training steps per impl")
    ap.add_argument("--gen-repeats", type=int, default=3, help="timed generate() calls per impl")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and shapes (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler's kernel table of one training step per implementation")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    args = ap.parse_args(argv)

    import transformers
    preset = TINY if args.tiny else FULL
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = ft_hf.register()
    impls = ("sdpa", name)

    cfg = transformers.LlamaConfig(**preset["model"], attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(cfg)
    model.to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    result = {"env": environment(device), "dtype": str(dtype).replace("torch.", ""),
              "model": {**preset["model"], "params": n_params}, "impl_name": name}
    print(f"{result['env']}\nmodel {n_params / 1e6:.0f}M params, {result['dtype']}", flush=True)

    # ---- training step ---------------------------------------------------------------------
    b, n = preset["train"]
    ids = torch.randint(0, cfg.vocab_size, (b, n), device=device)
    model.train()

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    times = {i: [] for i in impls}
    peak = {}
    losses = {}
    for impl in impls:  # warmup: compiles flashtune's kernels for these shapes
        model.set_attn_implementation(impl)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            _, losses[impl] = timed(step, device)
        if device.type == "cuda":
            peak[impl] = torch.cuda.max_memory_allocated(device) / 2**30
    for _ in range(args.repeats):
        for impl in impls:
            model.set_attn_implementation(impl)
            times[impl].append(timed(step, device)[0])
    result["train"] = {}
    for impl in impls:
        med = statistics.median(times[impl])
        result["train"][impl] = {"median_ms": med * 1e3, "ms": [t * 1e3 for t in times[impl]],
                                 "tokens_per_s": b * n / med, "peak_gib": peak.get(impl),
                                 "loss": float(losses[impl])}
        print(f"train  {impl:14s} {med * 1e3:9.2f} ms  {b * n / med:12.0f} tok/s  "
              f"peak {peak.get(impl) or 0:.1f} GiB  loss {float(losses[impl]):.4f}", flush=True)

    if args.profile and device.type == "cuda":  # which kernels a training step spends its time in
        result["train_kernels_ms"] = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            step()
            sync(device)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                sync(device)
            per: dict = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name[:80]] = per.get(e.name[:80], 0.0) + e.device_time / 1e3
            top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:14])
            result["train_kernels_ms"][impl] = {"total": sum(per.values()), "top": top}
            print(f"train kernels {impl}: {sum(per.values()):.2f} ms in all")
            for k_, v_ in top.items():
                print(f"    {v_:8.3f}  {k_}")

    # ---- generation ------------------------------------------------------------------------
    model.eval()
    gb, prompt, new = preset["gen"]
    prompts = torch.randint(0, cfg.vocab_size, (gb, prompt), device=device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    gtimes = {i: [] for i in impls}
    outs = {}
    with torch.no_grad():
        logits = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            logits[impl] = model(input_ids=prompts).logits.float()
            model.generate(prompts, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warmup
        for _ in range(args.gen_repeats):
            for impl in impls:
                model.set_attn_implementation(impl)
                t, outs[impl] = timed(lambda: model.generate(prompts, **kw), device)
                gtimes[impl].append(t)
    result["generate"] = {}
    for impl in impls:
        med = statistics.median(gtimes[impl])
        result["generate"][impl] = {"median_s": med, "s": gtimes[impl],
                                    "tokens_per_s": gb * new / med}
        print(f"gen    {impl:14s} {med:9.3f} s   {gb * new / med:12.1f} tok/s", flush=True)

    # ---- agreement -------------------------------------------------------------------------
    a, f = outs["sdpa"][:, prompt:], outs[name][:, prompt:]
    same = (a == f).int()
    first_diff = [int(row.argmin()) if not row.all() else new for row in same]
    ls, lf = logits["sdpa"], logits[name]
    result["check"] = {
        "prefill_logits_max_abs_diff": float((ls - lf).abs().max()),
        "prefill_logits_max_abs": float(ls.abs().max()),
        "train_loss_diff": abs(float(losses["sdpa"]) - float(losses[name])),
        "greedy_tokens_equal_before_first_difference": first_diff,
        "greedy_first_token_equal": bool(same[:, 0].all()),
    }
    result["ratio"] = {
        "train_speedup": result["train"]["sdpa"]["median_ms"] / result["train"][name]["median_ms"],
        "generate_speedup": result["generate"][name]["tokens_per_s"]
        / result["generate"]["sdpa"]["tokens_per_s"],
    }
    print(json.dumps({"check": result["check"], "ratio": result["ratio"]}, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
