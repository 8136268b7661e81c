"""The gate rule and the scorers called with the spec's defaults for what a test does not give.

Below the schema nothing has a default of its own (tests/control/test_defaults_once.py): the gate step passes
its ``GateConfig``'s settings, the evaluate step its ``EvaluateConfig``'s. Tests that vary one setting take
the rest from the same place, the spec schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraflow.evaluation import gate_rule
from loraflow.evaluation.metrics import Scoring
from loraflow.spec.schema import EvaluationSpec, GuardSpec
from loraflow.spec.step_configs import GateConfig

GATE = GateConfig()  # a spec without a gate section
RULE_SETTINGS = ("metric", "min_improvement", "confidence", "bootstrap_samples", "seed")


def decide(base: Mapping[str, bool], tuned: Mapping[str, bool], **given: Any) -> gate_rule.Decision:
    """``gate_rule.decide`` with ``given``, else the spec's settings (a metric where higher is better)."""
    settings = {name: getattr(GATE, name) for name in RULE_SETTINGS} | {"higher_is_better": True}
    return gate_rule.decide(base, tuned, **(settings | given))


def guard_check(
    base: Mapping[str, bool], tuned: Mapping[str, bool], *, max_drop: float, **given: Any
) -> gate_rule.GuardCheck:
    """``gate_rule.guard_check`` with ``given``, else the spec's settings (gate.guard.rule's default)."""
    settings = {name: getattr(GATE, name) for name in ("confidence", "bootstrap_samples", "seed")}
    defaults = settings | {"rule": GuardSpec.model_fields["rule"].default, "guard_set": "guard"}
    return gate_rule.guard_check(base, tuned, max_drop=max_drop, **(defaults | given))


def scoring(**given: Any) -> Scoring:
    """The scoring settings of a spec's evaluation section with ``given`` (metrics, answer_pattern, ...)."""
    return Scoring.of(EvaluationSpec(**given))
