"""Generate docs/spec-reference.md from the spec schema, so the reference never drifts from the code."""

from __future__ import annotations

import functools
import operator
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from loraflow.spec.compute import COMPUTE_CLASSES, DEFAULT_LAUNCHER, LAUNCHER_NAMES, launcher_name
from loraflow.spec.schema import STAGES, ParamSpec, PipelineSpec

HEADER = """# Pipeline spec reference

Generated from `loraflow/spec/schema.py` by `loraflow spec-reference > docs/spec-reference.md`; a test fails
when this file and the schema disagree. A spec is one YAML file in `pipelines/` named after its
`name`. `loraflow validate` checks specs and lists every problem at once; `loraflow plan SPEC` shows
what a spec resolves to.

A spec is read with limits (`loraflow/spec/reader.py`: at most 1 MiB, YAML aliases bounded once
expanded) and must be plain data: a key given twice in one mapping, and values tagged other than as
strings, numbers, booleans, null, lists and mappings (`!!binary`, `!!set`, an unquoted date), are
refused. Every value is of its setting's type, strictly (`loraflow/spec/fields.py`): a number is
never a boolean (`true`, `yes`, `on`) or quoted text (`"0.05"`), a boolean never `1` or `"no"` (a
whole number is a float setting's too); every number is finite and at most 2**53 in size; tags and
display names hold no control, invisible or direction-changing characters. Values that end up in a
Google Cloud or Kubernetes request (regions, project ids, bucket names, machine types, images,
namespaces, service accounts, networks, reservations) must have their kind's form
(`loraflow/spec/resource_names.py`). `compute.*.env` takes only the variables of an allow-list, each
with the values it takes (`loraflow/spec/env_rules.py`: `XLA_FLAGS` and `LIBTPU_INIT_ARGS` with flags
of a flag allow-list, log levels, ...); `secrets` may not name variables that change the interpreter,
the loader, TLS, proxies, credentials or loraflow's own wiring; `base_model.model_overrides` takes only
the MaxText settings of its allow-list (`loraflow/spec/override_rules.py`: the model family's shape
keys and a few tuning knobs). See [security.md](security.md).
"""


def _plain(annotation: Any) -> Any:
    """``annotation`` without ``Annotated[...]`` wrappers (validators are no part of the reference)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _plain(args[0])
    if origin in (list, dict):
        return origin[tuple(_plain(a) for a in args)]
    if origin in (Union, UnionType):
        return functools.reduce(operator.or_, (_plain(a) for a in args))
    return annotation


def _type(annotation: Any) -> str:
    annotation = _plain(annotation)
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    text = (text or str(annotation)).replace("typing.", "").replace("loraflow.spec.schema.", "")
    text = text.replace("loraflow.spec.compute.", "")
    return text.replace("NoneType", "null").replace("None", "null").replace("|", "\\|")


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    if field.default is PydanticUndefined:
        made = field.default_factory()  # type: ignore[call-arg, misc]
        return "(see below)" if isinstance(made, BaseModel) else f"`{made!r}`"
    if isinstance(field.default, BaseModel):
        return "(see below)"
    return f"`{field.default!r}`" if field.default is not None else "`null`"


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        bounds = [f"{sym} {getattr(m, attr)}" for m in field.metadata for attr, sym in _BOUNDS if hasattr(m, attr)]
        if bounds:
            desc = f"{desc} ({', '.join(bounds)})" if desc else ", ".join(bounds)
        rows.append(f"| `{prefix}{name}` | `{_type(field.annotation)}` | {_default(field)} | {desc} |")
    return rows


def _nested(annotation: Any, key: str) -> list[tuple[str, type[BaseModel]]]:
    """The spec sections inside a field's type: a model, an optional model, a list or a dict of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(key, annotation)]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list:
        return [found for arg in args for found in _nested(arg, f"{key}[]")]
    if origin is dict:
        return [found for arg in args[1:] for found in _nested(arg, f"{key}.<name>")]
    return [found for arg in args for found in _nested(arg, key)]


def _sections(model: type[BaseModel], prefix: str) -> list[str]:
    """A table for ``model`` and, below it, one section per nested section, depth first."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        for key, sub in _nested(field.annotation, f"{prefix}{name}"):
            if sub in (*COMPUTE_CLASSES, ParamSpec):  # documented with their own prose below
                continue
            doc = (sub.__doc__ or "").strip().splitlines()
            out += ["", f"## `{key}`", *([doc[0], ""] if doc else []), *_table(sub, f"{key}.")]
            out += _sections(sub, f"{key}.")
    return out


def _launcher_tables() -> list[str]:
    out: list[str] = []
    for model in COMPUTE_CLASSES:
        doc = (model.__doc__ or "").strip().splitlines()
        out += ["", f"### `launcher: {launcher_name(model)}`", *([doc[0], ""] if doc else []), *_table(model, "")]
    return out


def render() -> str:
    out = [HEADER, "## Top level", *_table(PipelineSpec, ""), *_sections(PipelineSpec, "")]
    out += [
        "",
        "## `compute.<stage>`",
        f"Keys: `default` or a stage: {', '.join(f'`{s}`' for s in STAGES)}. A stage without an entry uses `default`.",
        f"Its `launcher` ({', '.join(f'`{name}`' for name in LAUNCHER_NAMES)}; default `{DEFAULT_LAUNCHER}`) decides "
        "which keys it takes: each launcher has its own below, and a key of another launcher is refused.",
        *_launcher_tables(),
        "",
        "## `params[]`",
        "Each entry becomes an Airflow Param named like the path with dots as underscores"
        " (`training.steps` -> `training_steps`), shown on the trigger form with its bounds;"
        " Airflow refuses a value outside them before any task runs.",
        "",
        *_table(ParamSpec, ""),
        "",
    ]
    return "\n".join(out)
