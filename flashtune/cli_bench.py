"""`flashtune bench`: flashtune beside SDPA's backends and FlexAttention on the standard,
decode, varlen and mask grids, with the report (markdown, CSV, JSON, plots) in one folder."""
from __future__ import annotations

import shlex
from pathlib import Path

import click

from .cli_params import HEAD_DIM, comma_list

OUT_FILES = "bench.json, bench.csv, bench.md and dense/decode/memory.png"


def _names(choices):
    def callback(ctx, param, values):
        out = []
        for v in values:
            for part in (p.strip() for p in str(v).split(",")):
                if part and choices is not None and part not in choices:
                    raise click.BadParameter(f"{part!r}; expected one of {', '.join(choices)}",
                                             ctx, param)
                if part:
                    out.append(part)
        return tuple(dict.fromkeys(out))
    return callback


def _ints(ctx, param, values):
    out = []
    for v in values:
        for part in (p.strip() for p in str(v).split(",")):
            if part:
                try:
                    out.append(int(part))
                except ValueError:
                    raise click.BadParameter(f"{part!r} is not an integer", ctx, param) from None
    return tuple(dict.fromkeys(out))


def _command_line(ctx) -> str:
    """The options this run was given, as a command that repeats it."""
    parts = ["flashtune", "bench"]
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name in ("from_json", "resume_json"):
            continue
        v = ctx.params.get(p.name)
        default = p.get_default(ctx, call=True)
        if p.multiple and default is not None:
            default = p.process_value(ctx, default)
        if v == default or v in (None, ()):
            continue
        opt = p.opts[0]
        if p.is_flag:
            parts.append(opt if v else (p.secondary_opts or [opt])[0])
        else:
            parts += [opt, ",".join(map(str, v)) if isinstance(v, tuple) else str(v)]
    return shlex.join(parts)


def render(doc: dict, out: Path, plots: bool = True) -> list[Path]:
    """Write the report files of `doc` into `out`; their paths."""
    from .bench import plots as plotting
    from .bench import report
    out.mkdir(parents=True, exist_ok=True)
    images = plotting.write_plots(doc, out) if plots else {}
    report.write_json(doc, out / "bench.json")
    report.write_csv(doc, out / "bench.csv")
    (out / "bench.md").write_text(report.markdown(doc, images))
    return [out / "bench.json", out / "bench.csv", out / "bench.md"] + \
        [out / v for k, v in images.items() if k != "note"]


@click.command("bench")
@click.option("--quick", is_flag=True,
              help="smoke run: D 64/128, N 1k/4k, fewer decode/varlen/mask/memory points "
                   "(on the CPU every run uses interpreter-sized shapes)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench_out"), show_default=True,
              help=f"folder for the report: {OUT_FILES}")
@click.option("--from", "from_json", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="render the report (tables, plots) from saved bench.json files instead of "
                   "measuring: no GPU needed (repeat to merge runs of one device)")
@click.option("--whole-cases", is_flag=True,
              help="with --from: a later file's case replaces all the earlier files' rows of it, "
                   "the peers it did not time included (no ratio compares two runs)")
@click.option("--resume", "resume_json", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="an earlier bench.json of this device (e.g. a run cut by a time limit): its "
                   "finished cells are kept, the rest measured")
@click.option("--section", "sections", multiple=True, default=(),
              callback=_names(("dense", "decode", "varlen", "masks", "memory", "bnhd")),
              help="what to run (repeat or comma-separate): dense, decode, varlen, masks, "
                   "memory (default: these five), bnhd (the dense grid with q, k, v in "
                   "(B, N, H, D) memory, as a transformers model passes them)")
@click.option("--peer", "peers", multiple=True, default=(), callback=_names(None),
              help="implementations to time (repeat or comma-separate; default: all): "
                   "flashtune, flashtune-defaults, flashtune-paged256 (decoding), sdpa-flash, "
                   "sdpa-cudnn, sdpa-efficient, flex, sdpa-math (memory table only), "
                   "plain-read (decoding: the caches streamed once, the cell's read ceiling)")
@click.option("--mode", "modes", multiple=True, default=(),
              callback=_names(("fwd", "bwd", "fwd+bwd")),
              help="passes of the dense, varlen and mask grids: fwd, bwd, fwd+bwd (default: all)")
@click.option("--head-dim", "head_dims", multiple=True, default=(), callback=comma_list(HEAD_DIM),
              help="head dims of the dense grid (default 64,128,256; hidden 2048 = H*D)")
@click.option("--seqlen", "seqlens", multiple=True, default=(), callback=_ints,
              help="N of the dense grid (default 512..16384; B*N = 16k tokens)")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto",
              show_default=True,
              help="cuda, or cpu (Triton's interpreter with TRITON_INTERPRET=1: a smoke run)")
@click.option("--budget-ms", type=click.FloatRange(1), default=None,
              help="timing budget per cell in ms (default 60, --quick 25)")
@click.option("--graph/--no-graph", default=True, show_default=True,
              help="time decoding steps as CUDA-graph replays (every peer alike: the GPU's "
                   "time without Python's launch cost)")
@click.option("--decode-layers", type=click.IntRange(1, 64), default=16, show_default=True,
              help="a decode cell times a step of this many layers, each with its own cache "
                   "(20 GiB of caches at most), per layer: how a server replays a step")
@click.option("--flex-dynamic/--flex-static", default=False, show_default=True,
              help="compile FlexAttention once with dynamic shapes instead of once per shape "
                   "(faster runs; static is what a model compiled for one shape gets)")
@click.option("--plots/--no-plots", default=True, show_default=True,
              help="write PNG plots (needs matplotlib: pip install 'flashtune[bench]')")
@click.option("--progress", type=click.Choice(["auto", "bar", "lines", "none"]), default="auto",
              show_default=True, help="a bar with ETA on a terminal, a line per case otherwise")
@click.pass_context
def bench(ctx, quick, out_dir, from_json, whole_cases, resume_json, sections, peers, modes,
          head_dims, seqlens, device, budget_ms, graph, decode_layers, flex_dynamic, plots,
          progress):
    """Benchmark flashtune beside SDPA and FlexAttention.

    Times flashtune (as dispatched, and with its built-in defaults) beside SDPA's flash, cuDNN
    and efficient backends and FlexAttention under torch.compile, in one run, on the standard,
    decode, varlen and mask grids, with peak memory and the matmul / copy ceilings of the
    device; prints the tables and writes them (markdown, CSV, JSON, PNG). A peer that cannot
    run a case is reported, never a crash.

    \b
      flashtune bench --out bench_out           # the full grids (long: --section splits it)
      flashtune bench --quick                   # smoke run
      flashtune bench --from bench_out/bench.json --out docs/bench   # re-render, no GPU
    """
    if whole_cases and not from_json:
        raise click.UsageError("--whole-cases merges saved runs: give them with --from")
    if from_json:
        from .bench.report import merge, read_json
        try:
            doc = merge([read_json(p) for p in from_json], whole_cases)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        written = render(doc, out_dir, plots)
        click.echo("wrote " + ", ".join(map(str, written)))
        return
    import torch

    from .bench import grid, runner
    from .bench.peers import by_names, default_peers

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device here", param_hint="--device")
    try:
        chosen = by_names(peers, flex_dynamic) if peers else default_peers(flex_dynamic)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--peer") from None
    # the CPU runs kernels in Triton's interpreter: interpreter-sized shapes whatever the flags
    shapes = (grid.Shapes.tiny() if device == "cpu" else
              grid.Shapes.quick() if quick else grid.Shapes())
    over = {k: v for k, v in (("head_dims", head_dims), ("seqlens", seqlens), ("modes", modes))
            if v}
    if over:
        import dataclasses
        shapes = dataclasses.replace(shapes, **over)
    resume = None
    if resume_json is not None:
        from .bench.report import read_json
        try:
            resume = read_json(resume_json)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--resume") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        doc = runner.run(shapes, sections or grid.DEFAULT_SECTIONS, chosen, device, quick=quick,
                         budget_ms=budget_ms or (25.0 if quick else 60.0), graph=graph,
                         progress=progress, checkpoint=out_dir / "bench.json",
                         command=_command_line(ctx), resume=resume,
                         decode_layers=decode_layers if device == "cuda" else 1)
    except runner.ResumeMismatch as e:
        raise click.BadParameter(str(e), param_hint="--resume") from None
    written = render(doc, out_dir, plots)
    from .bench.report import markdown
    click.echo("\n" + markdown(doc, {}))
    click.echo("wrote " + ", ".join(map(str, written)))
