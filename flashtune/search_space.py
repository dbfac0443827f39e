"""The search space of one (family, target, problem): params, pinning, constraints, feasibility.

Built from the family's JSON (search_spaces/<family>.json). Values the target lacks the
feature for are dropped (descriptor loads need TMA: never proposed before Hopper); a param
whose `when` is false for the problem is pinned to the Variant's default (causal_split means
nothing without a causal mask). A `when` that names other params is decided per proposal
instead (bwd: the dQ kernel's tiles only exist when dq == 'separate'; an atomic variant keeps
them at 0), so the space holds each kernel once and Optuna sees a conditional space. Optuna
sees power-of-two lists as log2 integers and runs of integers as integers, so TPE and CMA-ES
can use their order; everything else is categorical.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import itertools
import json
import math
from dataclasses import dataclass
from functools import cached_property

from . import feasibility
from .codegen import GENERATOR_VERSION, Variant, template_hash
from .problem import Problem
from .search_spaces import load_space
from .targets import Target

_SAFE_BUILTINS = {"min": min, "max": max, "abs": abs}


def _pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class Param:
    name: str        # the Variant field
    values: tuple
    when: str = ""   # expression over earlier params: searched only where true, else the default

    @property
    def kind(self) -> str:
        v = self.values
        if len(v) > 1 and all(_pow2(x) for x in v):
            logs = [int(math.log2(x)) for x in v]
            if logs == list(range(logs[0], logs[0] + len(v))):
                return "log2"
        if (len(v) > 1 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and list(v) == list(range(v[0], v[0] + len(v)))):
            return "int"
        return "cat"

    @property
    def optuna_name(self) -> str:
        return f"{self.name}_log2" if self.kind == "log2" else self.name

    def suggest(self, trial):
        if self.kind == "log2":
            lo = int(math.log2(self.values[0]))
            return 1 << trial.suggest_int(self.optuna_name, lo, lo + len(self.values) - 1)
        if self.kind == "int":
            return trial.suggest_int(self.name, self.values[0], self.values[-1])
        return trial.suggest_categorical(self.name, list(self.values))

    def optuna_values(self) -> list:
        if self.kind == "log2":
            return [int(math.log2(x)) for x in self.values]
        return list(self.values)

    def to_optuna(self, value):
        return int(math.log2(value)) if self.kind == "log2" else value


def _problem_names(problem: Problem) -> dict:
    return {"head_dim": problem.head_dim, "block_d": feasibility.block_d(problem.head_dim),
            "dtype_bytes": feasibility.dtype_bytes(problem.dtype), "causal": problem.causal,
            "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k, "batch": problem.batch,
            "heads": problem.heads, "group": problem.group,
            "masked": bool(problem.mask_kinds)}  # window / softcap / block mask


def _names_in(expr: str, where: str) -> set:
    try:
        return set(compile(expr, where, "eval").co_names)
    except SyntaxError as err:
        raise ValueError(f"{where}: cannot parse {expr!r}: {err.msg}") from None


def _evaluator(exprs: tuple, where: str):
    """Compile expressions once; evaluating one that names an unknown value is a clear error."""
    code = []
    for e in exprs:
        try:
            code.append((e, compile(e, where, "eval")))
        except SyntaxError as err:
            raise ValueError(f"{where}: cannot parse {e!r}: {err.msg}") from None

    def run(names: dict):
        for text, c in code:
            try:
                yield text, bool(eval(c, {"__builtins__": _SAFE_BUILTINS}, names))
            except NameError as err:
                raise ValueError(f"{where}: {text!r}: {err}; known names: {sorted(names)}") from None
    return run


@dataclass(frozen=True)
class Space:
    family: str
    target: Target
    problem: Problem
    params: tuple          # Param, each with the values this target and problem allow
    pinned: tuple          # (field, value): params with one value here, and `when`-false ones
    constraints: tuple     # expressions over params and problem names
    dropped: tuple         # (field, value, feature the target lacks)
    file_size: int         # the product of the file's lists, before anything is pruned

    @classmethod
    def build(cls, family: str, target: Target, problem: Problem) -> "Space":
        raw = load_space(family)
        if raw.get("family", family) != family:
            raise ValueError(f"search_spaces/{family}.json says family {raw['family']!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(Variant)}
        unknown = [p for p in raw["params"] if p not in defaults or p == "family"]
        if unknown:
            raise ValueError(f"search_spaces/{family}.json: params {unknown} are not Variant "
                             f"fields; known: {sorted(set(defaults) - {'family'})}")
        names = _problem_names(problem)
        where = f"search_spaces/{family}.json when"
        when = dict(raw.get("when", {}))
        order = list(raw["params"])
        # a `when` naming params is decided per proposal, after the params it names
        per_variant = {}
        for name, expr in when.items():
            used = _names_in(expr, where) & set(order)
            late = [u for u in used if order.index(u) >= order.index(name)]
            if late:
                raise ValueError(f"{where}: {name}: {expr!r} names {sorted(late)}, which must "
                                 f"come before {name!r} in params")
            if used:
                per_variant[name] = expr
        active = dict(_evaluator(tuple(e for n, e in when.items() if n not in per_variant),
                                 where)(names))
        feats = raw.get("target_features", {})
        params, pinned, dropped = [], [], []
        for name, values in raw["params"].items():
            if name in when and name not in per_variant and not active[when[name]]:
                pinned.append((name, defaults[name]))
                continue
            keep = []
            for v in values:
                need = feats.get(name, {}).get(str(v).lower() if isinstance(v, bool) else str(v))
                if need and not target.has(need):
                    dropped.append((name, v, need))
                else:
                    keep.append(v)
            if not keep:
                raise ValueError(f"search_spaces/{family}.json: {target.short} allows no value "
                                 f"of {name}")
            if name in per_variant:  # a param even with one value: it is not always there
                params.append(Param(name, tuple(keep), per_variant[name]))
            elif len(keep) == 1:
                pinned.append((name, keep[0]))
            else:
                params.append(Param(name, tuple(keep)))
        # a masked problem's variants carry its mask code (flashtune/masks.py): pinned, so a
        # dense problem's space (and its hash) is what it was
        from .families import get as _family
        own = _family(family).fields
        pinned += [(m, True) for m in problem.mask_kinds if m in own]
        constraints = tuple(raw.get("constraints", ()))
        if problem.block_density:  # the tiles divide the representative block mask's 128
            constraints += tuple(f"{t} <= 128" for t in ("block_m", "block_n", "block_m2",
                                                          "block_n2") if t in raw["params"])
        return cls(family, target, problem, tuple(params), tuple(pinned), constraints,
                   tuple(dropped),
                   math.prod(len(v) for v in raw["params"].values()))

    # -- identity --------------------------------------------------------------------------
    @cached_property
    def hash(self) -> str:
        """Changes with anything that makes old measurements of this space stale or different."""
        try:
            triton_version = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton_version = "none"
        blob = {"family": self.family, "target": self.target.short,
                "params": [[p.name, list(p.values)] for p in self.params],
                "pinned": [list(x) for x in self.pinned], "constraints": list(self.constraints),
                "model": feasibility.model_version(self.family), "template": template_hash(self.family),
                "generator": GENERATOR_VERSION, "triton": ".".join(triton_version.split(".")[:2])}
        conditional = {p.name: p.when for p in self.params if p.when}
        if conditional:  # only where present, so the hashes of spaces without any stay put
            blob["when"] = conditional
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]

    # -- Variant <-> values ----------------------------------------------------------------
    def variant(self, values: dict) -> Variant:
        return Variant(family=self.family, **dict(self.pinned), **values)

    @cached_property
    def _defaults(self) -> dict:
        return {f.name: f.default for f in dataclasses.fields(Variant)}

    @cached_property
    def _when(self) -> dict:
        """param name -> compiled `when` of the conditional params."""
        where = f"search_spaces/{self.family}.json when"
        return {p.name: compile(p.when, where, "eval") for p in self.params if p.when}

    def _active(self, p: Param, values: dict) -> bool:
        """Whether conditional param `p` is searched, given the values of the params before it."""
        if not p.when:
            return True
        names = dict(_problem_names(self.problem), **dict(self.pinned), **values)
        try:
            return bool(eval(self._when[p.name], {"__builtins__": _SAFE_BUILTINS}, names))
        except NameError as err:
            raise ValueError(f"search_spaces/{self.family}.json when: {p.when!r}: {err}; known "
                             f"names: {sorted(names)}") from None

    def _walk(self, choose) -> dict:
        """Values of every param in order; `choose(param)` gives an active param's value, an
        inactive one gets the Variant's default."""
        values: dict = {}
        for p in self.params:
            values[p.name] = choose(p) if self._active(p, values) else self._defaults[p.name]
        return values

    def suggest(self, trial) -> Variant:
        """Ask an Optuna trial for one value per active param (define-by-run)."""
        return self.variant(self._walk(lambda p: p.suggest(trial)))

    def contains(self, variant: Variant) -> bool:
        """Whether `variant` is one of variants() (before constraints), without listing them
        (bwd's space has ~55k): each active param's value is one of its values, the inactive
        ones and the pinned fields their defaults."""
        return self.project(variant) == variant

    def project(self, variant: Variant) -> Variant | None:
        """`variant` as a point of this space: the params this problem leaves inactive (a causal
        tile order in a non-causal bucket) at their defaults. None where an active param's value
        is not one of its values, or where it differs from the space's point in a field the
        space does not vary (pinned, or no param): not ours to change."""
        values = self._walk(lambda p: getattr(variant, p.name))
        if not all(values[p.name] in p.values for p in self.params if self._active(p, values)):
            return None
        try:
            point = self.variant(values)
            return point if point == dataclasses.replace(variant, **values) else None
        except ValueError:  # a combination the Variant itself refuses
            return None

    def optuna_params(self, variant: Variant) -> dict:
        """The trial params that propose `variant` (for enqueue_trial)."""
        values = self._walk(lambda p: getattr(variant, p.name))
        return {p.optuna_name: p.to_optuna(values[p.name]) for p in self.params
                if self._active(p, values)}

    def grid(self) -> dict:
        """For Optuna's GridSampler: every param's values, as the trials name them. (A grid
        point whose conditional params are off proposes a variant met before: a duplicate,
        answered without measuring.)"""
        return {p.optuna_name: p.optuna_values() for p in self.params}

    # -- pruning ---------------------------------------------------------------------------
    @cached_property
    def _constraints(self):
        return _evaluator(self.constraints, f"search_spaces/{self.family}.json constraints")

    def check(self, variant: Variant) -> feasibility.Verdict:
        names = _problem_names(self.problem)
        names.update({f.name: getattr(variant, f.name) for f in dataclasses.fields(Variant)})
        for text, ok in self._constraints(names):
            if not ok:
                return feasibility.Verdict(False, f"constraint {text}")
        return feasibility.check(variant, self.problem, self.target)

    def variants(self) -> list[Variant]:
        """Every distinct variant of this target's space (before constraints and the model)."""
        if not self._when:
            return [self.variant(dict(zip((p.name for p in self.params), combo)))
                    for combo in itertools.product(*(p.values for p in self.params))]
        out: list[dict] = [{}]
        for p in self.params:  # expand param by param: an inactive one does not multiply
            out = [dict(vals, **{p.name: x}) for vals in out
                   for x in (p.values if self._active(p, vals) else (self._defaults[p.name],))]
        return [self.variant(vals) for vals in out]

    @cached_property
    def feasible(self) -> tuple:
        return tuple(v for v in self.variants() if self.check(v).ok)

    def sizes(self) -> dict:
        """Space sizes at each pruning step (what --dry-run prints)."""
        allv = self.variants()
        names = _problem_names(self.problem)
        after_constraints = 0
        for v in allv:
            n = dict(names, **{f.name: getattr(v, f.name) for f in dataclasses.fields(Variant)})
            after_constraints += all(ok for _, ok in self._constraints(n))
        return {"file": self.file_size, "target": len(allv), "constraints": after_constraints,
                "feasible": len(self.feasible)}
