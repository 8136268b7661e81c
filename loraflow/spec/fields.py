"""The spec's building blocks shared by its sections: the strict base model, the checked name types,
and the checks every number and every displayed name of a spec passes."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

from loraflow.spec import env_rules
from loraflow.spec import resource_names as rn


class SpecModel(BaseModel):
    """A section of the spec: unknown keys are refused, values never change after validation, and
    every value is of its setting's own type (strict): a number is never ``true``, ``yes`` or text
    such as ``"0.05"`` (``max_drop: true`` became 1.0 and turned the regression guard off), a
    boolean never 1 or ``"no"``. A whole number is accepted for a float setting."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# Names a spec gives to environment variables of a step: loraflow/spec/env_rules.py. compute.*.env
# names are on its allow-list (StepEnvName); secrets names pass its rules and are named for a secret
# (SecretName).
StepEnvName = Annotated[str, AfterValidator(env_rules.check_step_name)]
EnvValue = Annotated[str, AfterValidator(env_rules.check_value)]
SecretName = Annotated[str, AfterValidator(env_rules.check_secret_name)]  # also named for a secret (HF_TOKEN)
# Names that go into Google Cloud and Kubernetes requests: loraflow/spec/resource_names.py.
Region = Annotated[str, AfterValidator(rn.check_region)]
ProjectId = Annotated[str, AfterValidator(rn.check_project)]
Image = Annotated[str, AfterValidator(rn.check_image)]

# ------------------------------------------------------------------------------------------ numbers

# Every number of a spec, wherever it sits (a typed setting, a model override, a param's enum, the
# data contract), is finite and at most 2**53 in size: the largest integer JSON readers (the trigger
# form's JavaScript) keep exactly, far beyond any step count, seed or delay a pipeline means.
# Infinity and NaN are no setting (`.inf` overflowed a retry delay's timedelta and took every DAG of
# the folder down; a NaN compares false with every bound). One check, applied by
# ``schema.validate_spec`` to the document as written and to the validated spec (text such as
# "1e29" becomes a number only there), so no section can forget it.
MAX_MAGNITUDE = 2**53


def number_problem(value: Any) -> str | None:
    """Why ``value``, a number of a spec, is refused; None if it is fine (or not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"is not a finite number (got {value}); write a number"
    if abs(value) > MAX_MAGNITUDE:
        shown = f"{value:.3g}" if isinstance(value, float) or abs(value) > 10**15 else str(value)
        return (
            f"is too large (got {shown}); a spec's numbers are at most {MAX_MAGNITUDE} (2**53) in size, "
            "far beyond any setting a pipeline means: write the value you mean"
        )
    return None


def number_problems(data: Any, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """``(dotted key, why)`` for every number under ``data`` (plain data: mappings, lists, scalars)
    that ``number_problem`` refuses."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[tuple[str, ...], Any]] = [(path, data)]
    while stack:  # iterative: the reader bounds the depth, but a validated spec is walked too
        where, node = stack.pop()
        if isinstance(node, dict):
            stack.extend(((*where, str(k)), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend(((*where, str(i)), v) for i, v in reversed(list(enumerate(node))))
        elif (why := number_problem(node)) is not None:
            out.append((".".join(where) or "(top level)", why))
    return out


# ----------------------------------------------------------------------------- text and names

# Characters that are invisible or reorder what is shown around them: zero-width spaces and joiners,
# the left-to-right/right-to-left marks, embeddings, overrides and isolates, the byte order mark. In a
# tag or a name they make two different values look alike, or one read backwards, in the Airflow UI.
INVISIBLE = re.compile("[\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_IN_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # text keeps \t, \n, \r
# Airflow 3's longest DAG tag (airflow.sdk.definitions.dag.TAG_MAX_LEN; a test pins it): a longer one
# fails the DAG's construction. Airflow is not imported here (the spec is read in the step images too).
TAG_MAX_LEN = 100


def _character(text: str, match: re.Match[str]) -> str:
    return f"U+{ord(match.group()):04X} at position {match.start() + 1}"


def check_text(value: str) -> str:
    """Free text shown by Airflow (a description): no control characters but tab and line breaks
    (a NUL, for one, cannot be stored in PostgreSQL, Airflow's database)."""
    if bad := _CONTROL_IN_TEXT.search(value):
        raise ValueError(f"holds a control character ({_character(value, bad)}); remove it")
    return value


def check_name(value: str, max_len: int, kind: str) -> str:
    """A name shown as written (a tag, a display name): 1 to ``max_len`` characters, no control,
    invisible or direction-changing characters."""
    if not value.strip():
        raise ValueError(f"is empty; write a {kind} or remove it")
    if len(value) > max_len:
        raise ValueError(f"is longer than {max_len} characters ({len(value)}); shorten it")
    if bad := _CONTROL.search(value):
        raise ValueError(f"holds a control character ({_character(value, bad)}); remove it")
    if bad := INVISIBLE.search(value):
        raise ValueError(
            f"holds an invisible or direction-changing character ({_character(value, bad)}), which makes it "
            "look like another value in the Airflow UI; remove it"
        )
    return value


def _check_tag(value: str) -> str:
    return check_name(value, TAG_MAX_LEN, "tag")  # TAG_MAX_LEN read at call time


Text = Annotated[str, AfterValidator(check_text)]
Tag = Annotated[str, AfterValidator(_check_tag)]
