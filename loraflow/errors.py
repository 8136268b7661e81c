"""The small family of errors loraflow raises; each message says what is wrong and what to do."""

from __future__ import annotations

import json

EXCERPT_CHARS = 80


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``value`` as an error message shows it: a string quoted, anything else as JSON writes it (true,
    null, [1]); a longer one cut to its first ``limit`` characters and its length, so a 5 MB value is
    refused without being echoed whole."""
    if isinstance(value, str):
        text = repr(value[:limit])
        return text if len(value) <= limit else f"{text}... ({len(value)} characters)"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class LoraflowError(Exception):
    """Base class: anything loraflow reports to a user."""


class SpecError(LoraflowError):
    """A pipeline spec is invalid. ``problems`` lists every one, as ``(key path, message)``."""

    def __init__(self, source: str, problems: list[tuple[str, str]], where: str = "the pipeline spec"):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s) in {where}"]
        lines += [f"  - {path}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class ArtifactError(LoraflowError):
    """An artifact is missing, uncommitted, tampered with or outside where it may be."""


class DataValidationError(LoraflowError):
    """The dataset broke its contract; the run stops before any training."""


class StepError(LoraflowError):
    """A step program failed."""
