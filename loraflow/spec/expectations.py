"""The data contract a spec declares: one rule per kind of data problem, each with a level.

In a spec::

    data:
      expectations:
        row_count: {min: 1000}                 # fail (the default level) below 1000 train rows
        token_length: {max: 32}
        near_empty: {level: fail, min_chars: 2}
        leakage: {level: warn}                 # report eval prompts seen in train, keep going

Every rule has a ``level``: ``fail`` stops the run before any conversion or training (one error
names every failed rule and its fix); ``warn`` records the finding in the data report, the
manifest summary and the run report, and the run continues. A rule left out keeps its defaults
(``DataExpectations()``). ``loraflow.steps.validate_data`` turns each rule into Great Expectations
expectations over the train and eval sets.

Pure: pydantic and the spec's base model (strict, as every section of it) only, no Great Expectations
here (the spec imports this module at DAG parse time).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loraflow.spec.fields import SpecModel

Level = Literal["fail", "warn"]
ROLE_NAMES = Literal["system", "user", "assistant"]
_DEFAULT_ROLES: tuple[ROLE_NAMES, ...] = ("user", "assistant")

# Keys of the data section before the rules existed, and where each lives now.
MOVED = {
    "min_rows": "expectations.row_count.min",
    "min_tokens": "expectations.token_length.min",
    "max_tokens": "expectations.token_length.max",
    "max_duplicate_fraction": "expectations.duplicates.max_fraction",
}


class Rule(SpecModel):
    level: Level = Field("fail", description="fail: stop the run; warn: record it and continue")


class FormatRule(Rule):
    """Every example ends with its assistant answer and has a turn of each required role."""

    required_roles: list[ROLE_NAMES] = Field(
        default_factory=lambda: list(_DEFAULT_ROLES), description="roles every example must contain"
    )


class TokenLengthRule(Rule):
    """Examples (the whole conversation rendered with the model's chat template) within bounds."""

    min: int = Field(1, ge=0, description="fewest tokens an example may have")
    max: int = Field(512, ge=8, description="most tokens an example may have")

    @model_validator(mode="after")
    def _ordered(self) -> TokenLengthRule:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max}); lower min or raise max")
        return self


class DuplicatesRule(Rule):
    """Examples that repeat an earlier one exactly (whitespace and case aside)."""

    max_fraction: float = Field(0.0, ge=0, le=1, description="share of repeated examples tolerated")


class NearEmptyRule(Rule):
    """Prompts or completions with (almost) no letters or digits, e.g. '...' or '-'."""

    level: Level = Field("warn", description="fail: stop the run; warn: record it and continue")
    min_chars: int = Field(1, ge=1, description="fewest letters or digits a prompt and a completion must each hold")


class RowCountRule(Rule):
    """Enough training rows (and at least one eval row)."""

    min: int = Field(100, ge=1, description="fewest training rows accepted")


class LeakageRule(Rule):
    """Eval prompts that also appear in the training set (whitespace and case aside)."""

    max_fraction: float = Field(0.0, ge=0, le=1, description="share of eval prompts that may also be in train")


class DataExpectations(SpecModel):
    """The data contract: each rule with its level (fail or warn) and thresholds."""

    format: FormatRule = Field(default_factory=FormatRule, description=FormatRule.__doc__)
    no_nulls: Rule = Field(default_factory=Rule, description="no prompt or completion is null")
    no_empty_strings: Rule = Field(default_factory=Rule, description="no prompt or completion is blank")
    token_length: TokenLengthRule = Field(default_factory=TokenLengthRule, description=TokenLengthRule.__doc__)
    unique_ids: Rule = Field(default_factory=Rule, description="no two rows share an id")
    duplicates: DuplicatesRule = Field(default_factory=DuplicatesRule, description=DuplicatesRule.__doc__)
    near_empty: NearEmptyRule = Field(default_factory=NearEmptyRule, description=NearEmptyRule.__doc__)
    row_count: RowCountRule = Field(default_factory=RowCountRule, description=RowCountRule.__doc__)
    leakage: LeakageRule = Field(default_factory=LeakageRule, description=LeakageRule.__doc__)

    def level(self, rule: str) -> Level:
        level: Level = getattr(self, rule).level
        return level


RULES = tuple(DataExpectations.model_fields)


def outcome(success: bool, level: Level) -> str:
    """What a rule's result means for the run: pass, warn or fail."""
    return "pass" if success else level


def moved_keys_message(keys: list[str]) -> str:
    """The error for a data section that still uses the keys from before the rules existed."""
    return "; ".join(f"data.{k} moved: write data.{MOVED[k]}" for k in keys)


def contract_broken_message(failures: list[tuple[str, str]]) -> str:
    """One message naming every failed rule (``(rule, what and how to fix)``) and how to relax it."""
    rules = list(dict.fromkeys(rule for rule, _ in failures))
    lines = [
        f"the data contract is broken: {len(rules)} rule(s) failed ({', '.join(rules)}); "
        "nothing was converted or trained:"
    ]
    lines += [f"  - [{rule}] {message}" for rule, message in failures]
    lines.append(
        "Fix the data (or the thresholds under data.expectations in the spec); to record a rule's findings "
        "without stopping the run, set data.expectations.RULE.level: warn."
    )
    return "\n".join(lines)
