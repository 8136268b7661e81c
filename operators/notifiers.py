"""Airflow notifiers for a spec's ``notify`` list: failure, promotion and hand-off verdict notices.

Each notifier gathers the facts of its event from the Airflow context, lets loraflow/reporting/notify.py word
the message, and sends it: ``FileNotifier`` appends one JSON line to a file, ``WebhookNotifier`` posts
JSON (``text`` plus the structured ``loraflow`` fields, the shape chat webhooks accept) to the URL of
an Airflow HTTP connection. The DAG factory attaches them: failure notices as every task's
``on_failure_callback``, promotion notices as publish's ``on_success_callback``, verdict notices as
the hand-off verdict task's ``on_success_callback``.
"""

from __future__ import annotations

import fcntl
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseNotifier, Context

from loraflow.pipeline import handoff
from loraflow.reporting import notify as notices
from loraflow.spec.stages import REPORT_HTML
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import GateSummary, PublishSummary

if TYPE_CHECKING:
    from loraflow.spec.schema import PipelineSpec

WEBHOOK_TIMEOUT_S = 15


def message_for(event: str, spec: PipelineSpec, context: Context) -> notices.Message | None:
    """The notice for ``event`` from what the context holds (None when there is nothing to say)."""
    ti = context["ti"]
    run_id = str(context.get("run_id") or ti.run_id)
    if event == "failure":
        error = context.get("exception")
        return notices.failure(
            spec.name,
            run_id,
            ti.task_id,
            f"{type(error).__name__}: {error}" if error is not None else None,
            getattr(ti, "try_number", None),
            getattr(ti, "log_url", None),
        )
    if event == "promotion":
        published = PublishSummary.from_xcom(ti.xcom_pull(task_ids="publish"))
        if published is None or not published.promoted:
            return None
        decision = GateSummary.from_xcom(ti.xcom_pull(task_ids="gate"))
        report = gcs.join(spec.artifact_root, spec.name, artifacts.safe_run_id(run_id), "report", REPORT_HTML)
        return notices.promotion(spec.name, run_id, published, decision, report)
    if event == "verdict":
        result_uri = (ti.xcom_pull(task_ids=ti.task_id) or {}).get("result")
        document = artifacts.read_json(result_uri) if result_uri else None
        return notices.verdict(document, result_uri) if document and result_uri else None
    raise ValueError(f"unknown notice event {event!r}; use failure, promotion or verdict")


class LoraflowNotifier(BaseNotifier, ABC):
    """Words the notice with loraflow.reporting.notify and hands it to ``send``."""

    def __init__(self, *, event: str, spec: dict[str, Any]) -> None:
        super().__init__()
        self.event = event
        self.spec = spec

    def notify(self, context: Context) -> None:
        from loraflow.spec.schema import PipelineSpec

        message = message_for(self.event, PipelineSpec.model_validate(self.spec), context)
        if message is not None:
            self.send(message)
            self.log.info("%s notice sent by %s: %s", self.event, type(self).__name__, message.subject)

    @abstractmethod
    def send(self, message: notices.Message) -> None:
        """Deliver one notice (a file line, a webhook POST)."""


class FileNotifier(LoraflowNotifier):
    """Appends each notice as one JSON line (locked, so concurrent tasks do not interleave)."""

    def __init__(self, *, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def send(self, message: notices.Message) -> None:
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(message.to_json() + "\n")


def webhook_url(conn: Any) -> str:
    """The URL an HTTP connection names: its host when that is a full URL, else scheme://host:port/path."""
    host = str(conn.host or "")
    if "://" in host:
        url = host
    else:
        port = f":{conn.port}" if conn.port else ""
        url = f"{conn.schema or 'https'}://{host}{port}"
    endpoint = (conn.extra_dejson or {}).get("endpoint")
    return url.rstrip("/") + "/" + str(endpoint).lstrip("/") if endpoint else url


class WebhookNotifier(LoraflowNotifier):
    """POSTs ``{"text": ..., "loraflow": {...}}`` (``notify.webhook_body``) to the URL held by an Airflow connection."""

    def __init__(self, *, connection: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.connection = connection

    def send(self, message: notices.Message) -> None:
        from airflow.sdk import BaseHook

        url = webhook_url(BaseHook.get_connection(self.connection))
        body = notices.webhook_body(message)  # Slack's escapes in the text, every field capped
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=WEBHOOK_TIMEOUT_S) as resp:
            resp.read()


def notifiers(spec: dict[str, Any], event: str) -> list[LoraflowNotifier]:
    """The notifiers of the spec's ``notify`` list (the spec as JSON data) that want ``event``."""
    out: list[LoraflowNotifier] = []
    for target in spec["notify"]:
        if event not in target["events"]:
            continue
        if target["kind"] == "file":
            out.append(FileNotifier(path=str(target["path"]), event=event, spec=spec))
        else:
            out.append(WebhookNotifier(connection=str(target["connection"]), event=event, spec=spec))
    return out


def attach_notifiers(spec: dict[str, Any], dag: Any) -> None:
    """Failure notices on every task; promotion notices on publish; verdict notices on the hand-off verdict."""
    if not spec["notify"]:
        return
    failure = notifiers(spec, "failure")
    for task in dag.tasks:
        if failure:
            task.on_failure_callback = failure
        if task.task_id == "publish":
            task.on_success_callback = notifiers(spec, "promotion") or None
        if task.task_id == handoff.VERDICT_TASK:
            task.on_success_callback = notifiers(spec, "verdict") or None
