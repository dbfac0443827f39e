"""`flashtune kernels list|show`: what the generator can emit, and the source of one variant."""
from __future__ import annotations

import json

import click

from .codegen import Variant, render, source_path, template_hash
from .codegen.render import GENERATOR_VERSION


@click.group()
def kernels():
    """Inspect the kernel generator."""


@kernels.command("list")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="a table for reading, or JSON for scripts")
def list_(fmt):
    """List the kernel families, their structural choices and tunables."""
    from .families import all_families
    from .search_spaces import describe_family  # the search space says what each family can vary
    rows = []
    for fam in all_families():
        try:
            row = describe_family(fam.name)
        except KeyError:  # a template without a search space yet: show what the template is
            row = {"family": fam.name, "template": fam.template, "choices": {}, "example": "-"}
        rows.append(dict(row, doc=fam.doc, kernels=list(fam.kernels),
                         interpreter=fam.interpreter, min_sm=fam.min_capability))
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    click.echo(f"flashtune generator {GENERATOR_VERSION}")
    for r in rows:
        click.echo(f"\n{r['family']}: {r['doc']}\n  template       {r['template']} "
                   f"({template_hash(r['family'])}), kernels {', '.join(r['kernels'])}")
        for k, vals in r["choices"].items():
            click.echo(f"  {k:<14} {', '.join(str(v) for v in vals)}")
        click.echo(f"  example        {r['example']}")


@kernels.command("show")
@click.argument("variant")
@click.option("--path", is_flag=True, help="print the cached file's path instead of the source")
def show(variant, path):
    """Print the Triton source of VARIANT (a name such as fwd-m128-n64-w8-s3, or its JSON)."""
    try:
        v = Variant.parse(variant)
    except (ValueError, TypeError) as e:
        raise click.BadParameter(str(e), param_hint="VARIANT") from None
    click.echo(str(source_path(v)) if path else render(v), nl=not path or True)


@kernels.command("check")
@click.argument("variants", nargs=-1)
@click.option("--gpu", default="H100", show_default=True, help="target to compile for")
@click.option("--head-dim", "head_dims", default="64,128", show_default=True,
              help="head dims to compile for (comma-separated)")
@click.option("--dtype", "dtypes", default="bf16", show_default=True, help="bf16, fp16, fp32")
@click.option("--causal/--no-causal", default=True, show_default=True,
              help="compile the causal or the non-causal kernels")
@click.option("--tails", is_flag=True, help="the ragged-seqlen / GQA specialisation")
@click.option("--table", "from_table", is_flag=True,
              help="compile the records of the GPU's shipped table instead, each at its bucket's "
              "head dim, dtype and causality (--head-dim, --dtype, --causal and --family, when "
              "given, narrow them)")
@click.option("--family", "families", default=None,
              help="only these kernel families (comma-separated)")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="a table for reading, or JSON for scripts")
@click.pass_context
def check(ctx, variants, gpu, head_dims, dtypes, causal, tails, from_table, families, fmt):
    """Compile VARIANTS (default: the target's built-in defaults; --table: its shipped table's
    records) for a GPU without one: shared memory, registers and spills per kernel. Exits 1 if a
    kernel exceeds the target's shared memory, spills registers, has its wgmmas serialized by
    ptxas (sm_90), or uses a feature the target lacks (descriptor loads need TMA)."""
    from . import env, targets
    from .problem import DTYPE_ALIASES
    if env.interpreting():
        raise click.UsageError("kernels check compiles real kernels: unset TRITON_INTERPRET")
    if from_table and variants:
        raise click.UsageError("give VARIANTS or --table, not both")
    from .compile_check import check_variant
    try:
        target = targets.get(gpu)
        ds = [int(d) for d in head_dims.split(",")]
        dts = [DTYPE_ALIASES[t.strip().lower()] for t in dtypes.split(",")]
        chosen = [Variant.parse(v) for v in variants]
    except (KeyError, ValueError) as e:
        raise click.BadParameter(str(e)) from None
    fams = {f.strip() for f in families.split(",")} if families else None
    cap = target.capability[0] * 10 + target.capability[1]
    if from_table:
        given = {p for p in ("head_dims", "dtypes", "causal")
                 if ctx.get_parameter_source(p) != click.core.ParameterSource.DEFAULT}
        cases = _table_cases(target, ds if "head_dims" in given else None,
                             dts if "dtypes" in given else None,
                             causal if "causal" in given else None, fams)
    else:
        cases = [(v, d, dtype, causal) for dtype in dts for d in ds
                 for v in (chosen or _defaults(cap, d, dtype, target.arch))
                 if fams is None or v.family in fams]
    if fmt == "table":
        click.echo(f"compiled for {target.short} ({target.arch}), smem limit "
                   f"{target.smem_per_block} B per block"
                   + (f"; {len(cases)} records of its table" if from_table else ""))
    rows, ok = [], True
    for v, d, dtype, c in cases:
        try:
            res = check_variant(v, d, dtype, causal=c, tails=tails, capability=cap)
        except Exception as e:  # noqa: BLE001 -- a config that cannot build is a result
            res = {"error": {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}}
        for kernel, r in res.items():
            why = _problems(v, r, target)
            ok &= not why
            row = dict(dtype=dtype, head_dim=d, causal=c, variant=v.name, kernel=kernel,
                       fits=not why, why=why, **r)
            rows.append(row)
            if fmt == "table":  # as each compiles: a table's records take minutes
                _echo_row(row)
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2))
    if not ok:
        raise SystemExit(1)


def _defaults(cap: int, d: int, dtype: str, arch: str) -> list:
    from .families import all_families
    return [v for fam in all_families() if fam.min_capability <= cap <= (fam.max_capability or cap)
            for v in fam.seed_variants(d, dtype, arch=arch)]


def _table_cases(target, dims, dtypes, causal, fams) -> list:
    """(variant, head dim, dtype, causal) of each distinct record of the target's shipped table,
    in table order; None: any."""
    from .tuned_db.io import read_table, table_path
    path = table_path(target.slug)
    if not path.exists():
        raise click.UsageError(f"--table: no shipped table for {target.short} ({path})")
    out = []
    for r in read_table(path).records:
        b = r.bucket
        case = (r.variant, b.head_dim, b.dtype, b.causal)
        if case in out or (dims is not None and b.head_dim not in dims) \
                or (dtypes is not None and b.dtype not in dtypes) \
                or (causal is not None and b.causal != causal) \
                or (fams is not None and r.variant.family not in fams):
            continue
        out.append(case)
    return out


def _echo_row(r: dict) -> None:
    detail = r.get("error") or (f"smem {r['smem']:>6} B  regs {r.get('regs')}  "
                                f"spills {r.get('spill_bytes')} B")
    click.echo(f"{r['dtype']:9} D={r['head_dim']:<4} {'causal' if r['causal'] else 'full  '} "
               f"{r['variant']:54} {r['kernel']:5} {'ok ' if r['fits'] else 'BAD'} {detail}"
               + (f"  ({'; '.join(r['why'])})" if r["why"] and "error" not in r else ""))


def _problems(variant: Variant, r: dict, target) -> list[str]:
    """Why a compiled kernel must not ship for `target` ([] when it may)."""
    if "error" in r:
        return ["does not compile"]
    why = []
    if r["smem"] > target.smem_per_block:
        why.append(f"shared memory {r['smem']} B > {target.smem_per_block} B")
    if r.get("spill_bytes"):  # local-memory traffic in the inner loop: slow, never a default
        why.append(f"spills {r['spill_bytes']} B")
    if r.get("wgmma"):  # ptxas serialized or waited on wgmmas the source keeps in flight: slow
        why.append("ptxas: " + "; ".join(r["wgmma"]))
    if variant.descriptors and not target.has("tma"):
        # Triton lowers descriptors to plain loads here: legal, but not what was measured
        why.append(f"descriptor loads need TMA, which {target.short} ({target.arch}) lacks")
    return why
