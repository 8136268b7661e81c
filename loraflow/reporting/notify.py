"""What a notice says: pure functions from a run's facts to a message (no Airflow, no I/O).

operators/notifiers.py gathers the facts from the Airflow context and sends the message through
the notifiers a spec's ``notify`` list names (a file, a webhook). One message per event:

- ``failure``: a task of a run failed (which task, the error, where its log is);
- ``promotion``: publish registered a model and moved the champion alias (version, metric before/after);
- ``verdict``: a hand-off run ended (accepted / rejected / failed with reasons, see loraflow/pipeline/handoff.py).

A notice carries strings that come from a dataset (a verdict's reasons quote the rows that broke the
data contract: a role, an id, a prompt) or from an error message. Each kind of sink has one helper
that makes any such string safe for it and bounded, used by every caller (docs/security.md, "Dataset
strings in notices"):

- plain text (a notice's ``text`` and ``subject``, e-mail, a task log line): :func:`plain_text`, one
  line, line breaks folded, control and invisible characters shown as escapes, at most N characters;
- Slack mrkdwn (a webhook's ``text``): :func:`slack_mrkdwn`, ``&``, ``<`` and ``>`` escaped as Slack
  documents (its only control characters: no mention, no disguised link), at most N characters;
- JSON (a file notice, a webhook's ``loraflow`` fields, ``_RESULT.json``, an asset event's extra):
  :func:`capped_json`, still JSON with the values as read, long strings and lists cut so that the
  whole is at most N bytes; :func:`capped_reasons` for a list of reasons.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from loraflow.storage.summaries import GateSummary, PublishSummary

MAX_ERROR_CHARS = 600
#: A verdict lists at most this many reasons (then "... and N more"), each at most this long; the
#: whole list stays in the run's data_report.json (validate_data/_rejected/).
MAX_REASONS = 10
MAX_REASON_CHARS = 300
#: A notice's text in Slack (its guidance: keep a message's text within 4,000 characters).
MAX_TEXT_CHARS = 4000
#: A webhook body, a file notice's line, _RESULT.json; an asset event's extra gets a quarter.
MAX_JSON_BYTES = 32 * 1024
MAX_EXTRA_BYTES = MAX_JSON_BYTES // 4
_CUT = "..."
# Shown as escapes in plain text: control characters and invisible or direction-changing ones (format),
# private-use and lone surrogates (which no UTF-8 reader can take).
_ESCAPED = frozenset({"Cc", "Cf", "Co", "Cs"})


@dataclass(frozen=True)
class Message:
    event: str
    pipeline: str
    run_id: str
    subject: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self, max_bytes: int = MAX_JSON_BYTES) -> str:
        """The notice as one line of JSON (the file notice's sink), at most ``max_bytes``."""
        return json.dumps(capped_json(asdict(self), max_bytes), sort_keys=True)


# ------------------------------------------------------------------------------------ sinks


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - len(_CUT), 0)] + _CUT


def plain_text(value: object, limit: int = MAX_REASON_CHARS) -> str:
    """``value`` as one line of plain text (a notice's text, an e-mail, a log line), at most ``limit``
    characters: runs of whitespace, line breaks included, become one space (a value cannot start a
    line that reads like the notice's own), control and invisible characters (``\\x1b``, ``\\u202e``)
    are written as their escapes."""
    text = " ".join(str(value).split())[: limit + 1]  # escapes only lengthen it: cut before
    text = "".join(
        ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) in _ESCAPED else ch for ch in text
    )
    return _cut(text, limit)


def slack_mrkdwn(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` (plain text) for a Slack message's ``text``, at most ``limit`` characters.

    Slack's mrkdwn has three control characters, ``&``, ``<`` and ``>`` (``<!channel>`` notifies a
    channel, ``<https://x|label>`` is a link showing only its label), and asks senders to escape exactly
    those as ``&amp;``, ``&lt;`` and ``&gt;``; all else (``*``, ``_``, a bare URL) only formats or
    shows as itself. A cut never splits an escape."""
    escaped = text[: limit + 1].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if len(escaped) <= limit:
        return escaped
    return re.sub(r"&[a-z]*$", "", escaped[: limit - len(_CUT)]) + _CUT


def _capped(value: Any, chars: int, items: int, depth: int) -> Any:
    if isinstance(value, str):
        return _cut(value, chars)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no nan or inf
    if depth <= 0:
        return _cut(str(value), chars)
    if isinstance(value, dict):
        kept = list(value.items())[:items]
        out = {_cut(str(k), chars): _capped(v, chars, items, depth - 1) for k, v in kept}
        if len(value) > items:
            out[_CUT] = f"{len(value) - items} more"
        return out
    if isinstance(value, (list, tuple)):
        out_list = [_capped(v, chars, items, depth - 1) for v in value[:items]]
        return out_list + ([f"... and {len(value) - items} more"] if len(value) > items else [])
    return _cut(str(value), chars)


def capped_json(value: Any, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``value`` for a JSON sink: the same structure and values, with strings, lists and mappings cut
    (and nan/inf, which JSON cannot hold, as strings) until ``json.dumps`` of it is at most
    ``max_bytes``. No escaping beyond JSON's own: a reader of JSON treats every value as data."""
    capped: Any = None
    for chars, items in ((MAX_TEXT_CHARS, 50), (1000, 20), (MAX_REASON_CHARS, MAX_REASONS), (60, 5)):
        capped = _capped(value, chars, items, depth=6)
        size = len(json.dumps(capped, sort_keys=True))  # ASCII: its length is its size in bytes
        if size <= max_bytes:
            return capped
    return _cut(json.dumps(capped, sort_keys=True), max_bytes // 2 - 2)  # as one string: JSON at most doubles it


def capped_reasons(reasons: Iterable[object]) -> list[str]:
    """A verdict's reasons for any sink: at most ``MAX_REASONS``, each at most ``MAX_REASON_CHARS``
    (values as given; quote them for the sink too), then one saying how many more there were."""
    items = [str(r) for r in reasons]
    out = [_cut(r, MAX_REASON_CHARS) for r in items[:MAX_REASONS]]
    return out + ([f"... and {len(items) - MAX_REASONS} more"] if len(items) > MAX_REASONS else [])


def webhook_body(message: Message, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The webhook's sink: ``{"text": <Slack mrkdwn>, "loraflow": <the notice as JSON>}`` (the shape
    chat webhooks accept), at most ``max_bytes``."""
    limit = MAX_TEXT_CHARS
    text = slack_mrkdwn(message.text, limit)
    while len(json.dumps(text)) > max_bytes // 2:  # non-ASCII text: JSON's escapes take up to 12 bytes
        limit //= 2
        text = slack_mrkdwn(message.text, limit)
    fields = capped_json(asdict(message), max_bytes // 2 - 32)
    return json.dumps({"text": text, "loraflow": fields}, sort_keys=True).encode()


def _shorten(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return plain_text(text, limit)


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
    published: PublishSummary,
    decision: GateSummary | None,
    report: str | None = None,
) -> Message:
    """Publish registered ``published.version``; ``decision`` is the gate's summary (its ``ci`` is the
    ``confidence`` interval of tuned - base: the level this run's gate used, whatever the DAG's spec says)."""
    version = published.version
    lines = [f"{pipeline} promoted model version {version} (run {run_id})."]
    if decision and decision.base is not None and decision.tuned is not None:
        ci = decision.ci
        interval = f", {_level(decision)}interval of the gain [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
        lines.append(f"Metric before: {decision.base:.3f}, after: {decision.tuned:.3f}{interval}.")
    if decision and decision.reason:
        lines.append(f"Gate: {decision.reason}")
    if published.model_manifest:
        lines.append(f"Model: {published.model_manifest}")
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
            "model_manifest": published.model_manifest,
            "base": decision.base if decision else None,
            "tuned": decision.tuned if decision else None,
            "report": report,
        },
    )


def _level(decision: GateSummary) -> str:
    """ "90% " for a gate summary whose interval is a 90% one; nothing for a summary that does not say (one
    written before the summary recorded its confidence)."""
    return "" if decision.confidence is None else f"{100 * decision.confidence:g}% "


def verdict(result: dict[str, Any], result_uri: str) -> Message:
    """A hand-off run's verdict (``result`` is the _RESULT.json document)."""
    model = result.get("model") or {}
    head = f"Dataset {result['dataset']} was {result['verdict']} by {result['pipeline']} (run {result['run_id']})."
    reasons = capped_reasons(result.get("reasons") or [])  # they quote the dataset
    lines = [head, *(f"- {r}" for r in reasons)]
    if model.get("version") is not None:
        lines.append(f"Model version {model['version']} was promoted.")
    lines.append(f"Result: {result_uri}")
    if result.get("report"):
        lines.append(f"Report: {result['report']}")
    return Message(
        "verdict",
        result["pipeline"],
        result["run_id"],
        plain_text(f"[loraflow] {result['pipeline']}: dataset {result['version']} {result['verdict']}"),
        "\n".join(plain_text(line, MAX_REASON_CHARS + 2) for line in lines),
        {
            "verdict": result["verdict"],
            "dataset": result["dataset"],
            "version": result["version"],
            "reasons": reasons,
            "model_version": model.get("version"),
            "result": result_uri,
        },
    )
