"""Click parameter types the cli_* modules share, so that an option means the same everywhere:
a --dtype accepts the spellings of problem.parse_dtype, a --head-dim passes the API's own check
(validate.check_head_dim), whichever command it is on."""
from __future__ import annotations

import click

from .problem import DTYPE_ALIASES, parse_dtype
from .validate import MAX_HEAD_DIM, MIN_HEAD_DIM, check_head_dim

DTYPE_HELP = "bf16, fp16, fp32 (or bfloat16, float16, half, float32)"
HEAD_DIM_HELP = f"head dim, {MIN_HEAD_DIM}..{MAX_HEAD_DIM}"


class _DType(click.ParamType):
    name = "dtype"

    def convert(self, value, param, ctx):
        try:
            return parse_dtype(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)

    def shell_complete(self, ctx, param, incomplete):
        from click.shell_completion import CompletionItem
        return [CompletionItem(a) for a in DTYPE_ALIASES if a.startswith(incomplete.lower())]


class _HeadDim(click.ParamType):
    name = "int"

    def convert(self, value, param, ctx):
        try:
            d = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer", param, ctx)
        try:
            return check_head_dim(d)
        except ValueError as e:
            self.fail(str(e), param, ctx)


DTYPE = _DType()
HEAD_DIM = _HeadDim()


def comma_list(kind: click.ParamType):
    """A callback for a `multiple=True` option whose values may also be comma-separated
    ("--dtype bf16,fp16 --dtype fp32"): each item converted by `kind`, duplicates dropped."""
    def callback(ctx, param, values):
        out = []
        for v in values:
            out += [kind.convert(part.strip(), param, ctx) for part in str(v).split(",")
                    if part.strip()]
        return tuple(dict.fromkeys(out))
    return callback
