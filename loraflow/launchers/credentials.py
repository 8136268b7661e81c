"""Secrets for step programs: named in the spec, resolved when a task runs, passed only by environment.

A spec's ``secrets`` maps an environment variable name (``HF_TOKEN``) to an Airflow connection id and
field. The operator looks the connection up at execute time (Airflow's connections or its secrets
backend), registers each value with Airflow's secret masker and hands the resolved mapping to
``runner.run_stage``. This module is the Airflow-free part: which secrets a stage gets, how a value
is read from a connection-like object, a redactor that replaces values in any text the runner passes
on (step output lines, error messages), and the fingerprint logged instead of a value. Values never
go into argv, XCom, manifests, reports, plans or cache keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from loraflow.errors import LoraflowError

if TYPE_CHECKING:
    from loraflow.spec.schema import PipelineSpec, SecretSpec

MASK = "***"


def wanted(spec: PipelineSpec, stage: str) -> dict[str, SecretSpec]:
    """The secrets ``stage`` receives: those without ``stages`` and those naming it."""
    return {name: ref for name, ref in spec.secrets.items() if ref.stages is None or stage in ref.stages}


def field_value(connection: Any, field: str) -> str | None:
    """``password``, ``login``, ``host`` or ``extra.KEY`` of a connection (Airflow's or a stand-in)."""
    if field.startswith("extra."):
        extra = getattr(connection, "extra_dejson", None) or {}
        value = extra.get(field.removeprefix("extra."))
        if isinstance(value, (dict, list)):
            return json.dumps(value)  # e.g. a service-account key stored as a JSON object
        return None if value is None else str(value)
    value = getattr(connection, field, None)
    return None if value is None else str(value)


def resolve(spec: PipelineSpec, stage: str, lookup: Callable[[str], Any]) -> dict[str, str]:
    """``{ENV_NAME: value}`` for ``stage``; ``lookup(conn_id)`` returns a connection or raises.

    Errors name the variable, the connection id and the field, never a value."""
    out: dict[str, str] = {}
    for name, ref in sorted(wanted(spec, stage).items()):
        try:
            connection = lookup(ref.connection)
        except Exception as exc:  # Airflow raises its own not-found type; say what to create
            raise LoraflowError(
                f"secret {name}: Airflow connection {ref.connection!r} could not be read ({type(exc).__name__}); "
                f"create it (UI: Admin > Connections, or AIRFLOW_CONN_{ref.connection.upper()}) or fix secrets.{name}"
            ) from None
        value = field_value(connection, ref.field)
        if not value:
            raise LoraflowError(
                f"secret {name}: Airflow connection {ref.connection!r} has no {ref.field}; "
                f"set it there or change secrets.{name}.field"
            )
        out[name] = value
    return out


def fingerprint(value: str) -> str:
    """What logs may show of a secret: enough to tell two tokens apart, nothing to recover one."""
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:12]


class Redactor:
    """Replaces every secret value (and each line of a multi-line one) in a text with ``***``."""

    def __init__(self, values: Mapping[str, str] | None = None) -> None:
        whole: list[str] = []
        for value in (values or {}).values():
            whole.append(value)
            try:  # a JSON key: each string inside it (the private key itself) too
                whole += [v for v in json.loads(value).values() if isinstance(v, str) and len(v) >= 8]
            except (ValueError, AttributeError):
                pass
        parts = set(whole)
        for text in whole:  # and each line of a multi-line one, as a log line would carry it
            parts.update(line.strip() for line in text.splitlines() if len(line.strip()) >= 8)
        # Longest first, so a value containing another is replaced whole.
        self._parts = sorted((p for p in parts if p), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for part in self._parts:
            if part in text:
                text = text.replace(part, MASK)
        return text

    def __bool__(self) -> bool:
        return bool(self._parts)
