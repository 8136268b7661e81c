"""What a notice says: pure functions from a run's facts to a message (no Airflow, no I/O).

operators/notifiers.py gathers the facts from the Airflow context and sends the message through
the notifiers a spec's ``notify`` list names (a file, a webhook). One message per event:

- ``failure``: a task of a run failed (which task, the error, where its log is);
- ``promotion``: publish registered a model and moved the champion alias (version, metric before/after);
- ``verdict``: a hand-off run ended (accepted / rejected / failed with reasons, see loraflow/data/handoff.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_ERROR_CHARS = 600


@dataclass(frozen=True)
class Message:
    event: str
    pipeline: str
    run_id: str
    subject: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)


def _shorten(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure(
    pipeline: str, run_id: str, task: str, error: str | None, try_number: int | None = None, log_url: str | None = None
) -> Message:
    """A task failed (after its last retry, when Airflow calls the failure callback)."""
    error_text = _shorten(error) if error else "no error message was recorded"
    lines = [f"Task {task} of {pipeline} failed in run {run_id}" + (f" (try {try_number})." if try_number else ".")]
    lines.append(f"Error: {error_text}")
    if log_url:
        lines.append(f"Log: {log_url}")
    return Message(
        "failure",
        pipeline,
        run_id,
        f"[loraflow] {pipeline}: {task} failed",
        "\n".join(lines),
        {"task": task, "error": error_text, "try_number": try_number, "log_url": log_url},
    )


def promotion(
    pipeline: str,
    run_id: str,
    published: dict[str, Any],
    decision: dict[str, Any] | None,
    report: str | None = None,
    confidence: float = 0.95,
) -> Message:
    """Publish registered ``published['version']``; ``decision`` is the gate's summary (its ``ci``
    is the ``confidence`` interval of tuned - base)."""
    decision = decision or {}
    version = published.get("version")
    lines = [f"{pipeline} promoted model version {version} (run {run_id})."]
    if decision.get("base") is not None and decision.get("tuned") is not None:
        ci = decision.get("ci") or []
        interval = f", {100 * confidence:g}% interval of the gain [{ci[0]:+.3f}, {ci[1]:+.3f}]" if len(ci) == 2 else ""
        lines.append(f"Metric before: {decision['base']:.3f}, after: {decision['tuned']:.3f}{interval}.")
    if decision.get("reason"):
        lines.append(f"Gate: {decision['reason']}")
    if published.get("model_manifest"):
        lines.append(f"Model: {published['model_manifest']}")
    if report:
        lines.append(f"Report: {report}")
    return Message(
        "promotion",
        pipeline,
        run_id,
        f"[loraflow] {pipeline}: model version {version} promoted",
        "\n".join(lines),
        {
            "version": version,
            "model_manifest": published.get("model_manifest"),
            "base": decision.get("base"),
            "tuned": decision.get("tuned"),
            "report": report,
        },
    )


def verdict(result: dict[str, Any], result_uri: str) -> Message:
    """A hand-off run's verdict (``result`` is the _RESULT.json document)."""
    model = result.get("model") or {}
    head = f"Dataset {result['dataset']} was {result['verdict']} by {result['pipeline']} (run {result['run_id']})."
    lines = [head, *(f"- {r}" for r in result.get("reasons", []))]
    if model.get("version") is not None:
        lines.append(f"Model version {model['version']} was promoted.")
    lines.append(f"Result: {result_uri}")
    if result.get("report"):
        lines.append(f"Report: {result['report']}")
    return Message(
        "verdict",
        result["pipeline"],
        result["run_id"],
        f"[loraflow] {result['pipeline']}: dataset {result['version']} {result['verdict']}",
        "\n".join(lines),
        {
            "verdict": result["verdict"],
            "dataset": result["dataset"],
            "version": result["version"],
            "reasons": result.get("reasons", []),
            "model_version": model.get("version"),
            "result": result_uri,
        },
    )
