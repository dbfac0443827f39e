"""Render a Variant to Triton source from its family's template.

Templates are plain Python with line directives for structure only:

    #%if <expr>      #%elif <expr>      #%else      #%endif

where <expr> reads the variant's structural fields (Variant.structure()) and `interpret`
(True when the source is for Triton's CPU interpreter, which needs a workaround the GPU
kernels must not pay for). Everything a
constexpr can express stays a constexpr in the template. Rendering keeps every line where it
was -- dropped lines and directives become blank lines -- so a traceback's line number in a
generated file is the line number in its template. The first line, `#%header`, becomes a
one-line header naming the variant, the template and the generator version.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from .variant import Variant

GENERATOR_VERSION = "0.1.0"
TEMPLATE_DIR = Path(__file__).parent / "templates"


def template_name(family: str) -> str:
    """The template file of a kernel family, as its flashtune/families/ entry names it."""
    from flashtune.families import get
    try:
        return get(family).template
    except KeyError as e:
        raise TemplateError(f"no template: {e.args[0]}") from None


class TemplateError(ValueError):
    pass


@lru_cache(maxsize=None)
def template_text(family: str) -> str:
    return (TEMPLATE_DIR / template_name(family)).read_text()


@lru_cache(maxsize=None)
def template_hash(family: str) -> str:
    return hashlib.sha256(template_text(family).encode()).hexdigest()[:16]


def _eval(expr: str, env: dict, where: str):
    try:
        return bool(eval(expr, {"__builtins__": {}}, dict(env)))  # names: structural fields only
    except Exception as e:  # noqa: BLE001 -- re-raised with the template line
        raise TemplateError(f"{where}: cannot evaluate {expr!r}: {e}") from None


def render(variant: Variant, interpret: bool = False) -> str:
    """The Triton source of `variant`: the same variant always gives the same bytes.
    interpret: render for Triton's CPU interpreter (its `#%if interpret` blocks)."""
    name = template_name(variant.family)
    lines = template_text(variant.family).splitlines()
    env = dict(variant.structure(), interpret=interpret)
    out: list[str] = []
    # stack of (this branch active, some branch already taken, parent active)
    stack: list[tuple[bool, bool, bool]] = []
    active = True
    for i, line in enumerate(lines, 1):
        where = f"{name}:{i}"
        s = line.strip()
        if s.startswith("#%"):
            word, _, expr = s[2:].partition(" ")
            if word == "header":
                out.append(header(variant, interpret))
                continue
            if word == "if":
                taken = active and _eval(expr, env, where)
                stack.append((taken, taken, active))
                active = taken
            elif word in ("elif", "else"):
                if not stack:
                    raise TemplateError(f"{where}: #%{word} without #%if")
                _, done, parent = stack.pop()
                cond = True if word == "else" else _eval(expr, env, where)
                taken = parent and not done and cond
                stack.append((taken, done or taken, parent))
                active = taken
            elif word == "endif":
                if not stack:
                    raise TemplateError(f"{where}: #%endif without #%if")
                active = stack.pop()[2]
            else:
                raise TemplateError(f"{where}: unknown directive #%{word}")
            out.append("")
            continue
        out.append(line if active else "")
    if stack:
        raise TemplateError(f"{name}: {len(stack)} unclosed #%if")
    return "\n".join(out) + "\n"


def header(variant: Variant, interpret: bool = False) -> str:
    return (f"# flashtune generator {GENERATOR_VERSION} | template {template_name(variant.family)} "
            f"{template_hash(variant.family)} (line numbers match the template) | "
            f"variant {variant.name} {variant.to_json()}"
            + (" | for Triton's interpreter" if interpret else ""))


def _code_lines(src: str):
    # what executes: no header, comments or blank lines (a template edit that leaves a variant's
    # code alone, e.g. a new `#%if` branch another variant takes, keeps its kernel hash)
    for line in src.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            yield line.rstrip()


@lru_cache(maxsize=1024)
def kernel_hash(variant: Variant) -> str:
    """Hash of the code the variant runs on a GPU: what a timing measured. A tuned record whose
    kernel hash differs from the current one was measured on another kernel (stale)."""
    return hashlib.sha256("\n".join(_code_lines(render(variant))).encode()).hexdigest()[:16]
