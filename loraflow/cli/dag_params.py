"""``--param KEY=VALUE`` checked against a DAG's own Params (as Airflow's REST API reports them).

A value is read as JSON (``200``, ``0.5``, ``true``, ``null``) unless the param takes a string and
the JSON reading is not one of its types: then it is the text as given. Every problem is reported
at once, each naming the param and what it allows, before anything is triggered: an unknown key
(Airflow would pass it on silently), a wrong type, a value outside its enum, minimum or maximum,
a string too short, too long or not matching its pattern. NaN and Infinity are no value (JSON has
none, and a NaN passes every bound): ``NaN``, ``Infinity`` and a number too large for a float are
refused for a param that takes no string, and kept as text for one that does.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from loraflow.errors import LoraflowError, excerpt

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}


def conf_from(dag_id: str, params: Mapping[str, Any], assignments: Iterable[str]) -> dict[str, Any]:
    """The run's conf from ``KEY=VALUE`` texts, checked against ``params`` (the DAG details' ``params``:
    name -> {"value", "schema", "description", ...}); ``LoraflowError`` lists every problem."""
    conf: dict[str, Any] = {}
    problems: list[str] = []
    for text in assignments:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"{text!r} is not KEY=VALUE")
            continue
        if key not in params:
            problems.append(_unknown(key, params))
            continue
        schema = _schema(params[key])
        try:
            value = _value(raw, schema)
        except _NotFinite:
            problems.append(
                f"param {key!r} = {excerpt(raw)} is not a finite number (JSON has no NaN or Infinity); write a number"
            )
            continue
        problem = value_problem(value, schema)
        if problem:
            problems.append(f"param {key!r} = {excerpt(value)} {problem}")
        conf[key] = value
    if problems:
        raise LoraflowError(f"DAG {dag_id}: refused before triggering: " + "; ".join(problems))
    return conf


def _schema(param: Any) -> dict[str, Any]:
    schema = param.get("schema") if isinstance(param, Mapping) else None
    return dict(schema) if isinstance(schema, Mapping) else {}


def _unknown(key: str, params: Mapping[str, Any]) -> str:
    names = sorted(params)
    near = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    listed = ", ".join(names) if names else "none: this DAG takes no params"
    return f"{key!r} is no param of this DAG (its params: {listed}){hint}"


def _allowed_types(schema: Mapping[str, Any]) -> list[str]:
    declared = schema.get("type")
    if declared is None:
        return []
    return [declared] if isinstance(declared, str) else [str(t) for t in declared]


class _NotFinite(ValueError):
    """A JSON reading of a value that holds NaN, Infinity or a number beyond a float's range."""


def _not_finite(text: str) -> float:
    raise _NotFinite(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise _NotFinite(text)
    return value


def _value(raw: str, schema: Mapping[str, Any]) -> Any:
    """``raw`` read as JSON (``_NotFinite`` for NaN or Infinity), or as the text itself when the
    param takes a string and the reading is none of its types."""
    types = _allowed_types(schema)
    try:
        value = json.loads(raw, parse_constant=_not_finite, parse_float=_finite)
    except _NotFinite:
        if "string" in types:
            return raw
        raise
    except ValueError:
        return raw
    if "string" in types and not _is_type(value, types):
        return raw
    return value


def _is_type(value: Any, types: list[str]) -> bool:
    for name in types:
        wanted = _TYPES.get(name, ())
        if isinstance(value, bool) and name in ("integer", "number"):
            continue  # JSON Schema: true is no number
        if name == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, wanted):
            return True
    return False


def value_problem(value: Any, schema: Mapping[str, Any]) -> str | None:
    """Why ``value`` breaks ``schema`` (the JSON Schema subset Params use), or None."""
    types = _allowed_types(schema)
    if types and not _is_type(value, types):
        return f"is not of type {' or '.join(types)}"
    if "enum" in schema and value not in schema["enum"]:
        return "is not one of the allowed values: " + ", ".join(json.dumps(v) for v in schema["enum"])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, bad in (
            ("minimum", lambda limit: value < limit),
            ("maximum", lambda limit: value > limit),
            ("exclusiveMinimum", lambda limit: value <= limit),
            ("exclusiveMaximum", lambda limit: value >= limit),
        ):
            if isinstance(schema.get(key), (int, float)) and bad(schema[key]):
                return f"breaks its {key} {schema[key]}"
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            return f"is shorter than its minLength {schema['minLength']}"
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            return f"is longer than its maxLength {schema['maxLength']}"
        if isinstance(schema.get("pattern"), str) and not re.search(schema["pattern"], value):
            return f"does not match its pattern {schema['pattern']!r}"
    return None
