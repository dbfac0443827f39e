"""`flashtune kernels list|show`: what the generator can emit, and the source of one variant."""
from __future__ import annotations

import json

import click

from .codegen import FAMILIES, TEMPLATES, Variant, render, source_path, template_hash
from .codegen.render import GENERATOR_VERSION, TEMPLATE_DIR


@click.group()
def kernels():
    """Inspect the kernel generator."""


@kernels.command("list")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
def list_(fmt):
    """List the kernel families, their structural choices and tunables."""
    from .search_spaces import describe_family  # the search space says what each family can vary
    rows = []
    for f in FAMILIES:
        if not (TEMPLATE_DIR / TEMPLATES[f]).exists():
            continue
        try:
            rows.append(describe_family(f))
        except KeyError:  # a template without a search space yet: show what the template is
            rows.append({"family": f, "template": TEMPLATES[f], "choices": {}, "example": "-"})
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    click.echo(f"flashtune generator {GENERATOR_VERSION}")
    for r in rows:
        click.echo(f"\n{r['family']}: template {r['template']} ({template_hash(r['family'])})")
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
