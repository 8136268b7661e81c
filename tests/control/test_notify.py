"""Notices: what they say (loraflow.reporting.notify) and how the Airflow notifiers deliver them."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.errors import SpecError
from loraflow.pipeline import artifacts
from loraflow.reporting import notify
from loraflow.spec.schema import load_spec, validate_spec

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
RUN = "manual__2026-12-03T01:00:00+00:00"


def test_a_failure_notice_names_the_task_the_error_and_the_log() -> None:
    m = notify.failure("tiny", RUN, "lora_sft", "StepError: killed\n  at step 40", 2, "http://af/log")
    assert m.event == "failure" and m.subject == "[loraflow] tiny: lora_sft failed"
    assert "Task lora_sft of tiny failed in run " + RUN + " (try 2)." in m.text
    assert "Error: StepError: killed at step 40" in m.text and "Log: http://af/log" in m.text
    assert m.data == {
        "task": "lora_sft",
        "error": "StepError: killed at step 40",
        "try_number": 2,
        "log_url": "http://af/log",
    }


def test_a_long_error_is_shortened_and_a_missing_one_said_so() -> None:
    m = notify.failure("tiny", RUN, "gate", "x" * 5000)
    assert len(m.data["error"]) == notify.MAX_ERROR_CHARS and m.data["error"].endswith("...")
    assert "no error message was recorded" in notify.failure("tiny", RUN, "gate", None).text


def test_a_promotion_notice_gives_the_version_and_the_metric_before_and_after() -> None:
    decision = {"base": 0.5, "tuned": 0.9125, "ci": [0.36, 0.46], "reason": "gain +0.41 clears 0.30"}
    published = {"promoted": True, "version": 4, "model_manifest": "gs://a/merge_adapter/_MANIFEST.json"}
    m = notify.promotion("tiny", RUN, published, decision, "gs://a/report/report.html", confidence=0.9)
    assert m.subject == "[loraflow] tiny: model version 4 promoted"
    assert "Metric before: 0.500, after: 0.912, 90% interval of the gain [+0.360, +0.460]." in m.text
    assert "Gate: gain +0.41 clears 0.30" in m.text and "Report: gs://a/report/report.html" in m.text
    assert m.data["version"] == 4 and m.data["tuned"] == 0.9125


def test_a_verdict_notice_lists_the_reasons() -> None:
    result = {
        "pipeline": "tiny",
        "run_id": RUN,
        "dataset": "gs://t/handoff/v2",
        "version": "v2",
        "verdict": "rejected",
        "reasons": ["data contract: 1 empty completion", "data contract: 2 duplicates"],
        "model": None,
        "report": None,
    }
    m = notify.verdict(result, "gs://t/handoff/v2/_RESULT.json")
    assert m.subject == "[loraflow] tiny: dataset v2 rejected"
    assert "- data contract: 1 empty completion\n- data contract: 2 duplicates" in m.text
    assert m.data["result"] == "gs://t/handoff/v2/_RESULT.json" and m.data["model_version"] is None
    assert json.loads(m.to_json())["data"]["verdict"] == "rejected"


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ({"kind": "file"}, "needs path"),
        ({"kind": "file", "path": "relative/notices.jsonl"}, "needs path"),
        ({"kind": "webhook"}, "needs connection"),
        ({"kind": "slack", "connection": "x"}, "kind"),
        ({"kind": "file", "path": "/tmp/n", "events": ["success"]}, "events"),
    ],
)
def test_bad_notify_entries_are_refused(target: dict[str, Any], expected: str) -> None:
    data = load_spec(TINY).model_dump(mode="json") | {"notify": [target]}
    with pytest.raises(SpecError, match=expected):
        validate_spec(data, "test")


# ------------------------------------------------------------------------------------ the notifiers


class FakeTI:
    """The few task-instance facts the notifiers read (a real one exists only inside a running task)."""

    def __init__(self, task_id: str, xcoms: dict[str, Any] | None = None) -> None:
        self.task_id, self.run_id, self.try_number, self.log_url = task_id, RUN, 1, f"http://af/{task_id}/log"
        self.xcoms = xcoms or {}

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids)


def notify_spec(tmp_path: Path, **target: Any) -> dict[str, Any]:
    """The tiny spec with one notify target, validated, as the JSON data a DAG holds."""
    data = load_spec(TINY).model_dump(mode="json") | {"notify": [target]}
    return validate_spec(data, "test").model_dump(mode="json")


def test_the_file_notifier_appends_one_json_line_per_notice(tmp_path: Path) -> None:
    from operators.notifiers import FileNotifier, notifiers

    path = tmp_path / "sub" / "notices.jsonl"
    spec = notify_spec(tmp_path, kind="file", path=str(path), events=["failure"])
    assert notifiers(spec, "promotion") == []
    (notifier,) = notifiers(spec, "failure")
    assert isinstance(notifier, FileNotifier)
    for task in ("validate_data", "gate"):
        notifier({"ti": FakeTI(task), "run_id": RUN, "exception": ValueError(f"{task} broke")})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(n["event"], n["data"]["task"]) for n in lines] == [("failure", "validate_data"), ("failure", "gate")]
    assert lines[1]["data"]["error"] == "ValueError: gate broke" and lines[1]["pipeline"] == spec["name"]


def test_a_promotion_notice_is_sent_only_when_publish_promoted(tmp_path: Path) -> None:
    from operators.notifiers import notifiers

    path = tmp_path / "notices.jsonl"
    spec = notify_spec(tmp_path, kind="file", path=str(path))
    (notifier,) = notifiers(spec, "promotion")
    gate = {"summary": {"promote": True, "base": 0.5, "tuned": 0.9, "ci": [0.3, 0.5], "reason": "ok"}}
    notifier({"ti": FakeTI("publish", {"publish": {"summary": {"promoted": False}}, "gate": gate}), "run_id": RUN})
    assert not path.exists()
    published = {"summary": {"promoted": True, "version": 2, "model_manifest": "gs://m/_MANIFEST.json"}}
    notifier({"ti": FakeTI("publish", {"publish": published, "gate": gate}), "run_id": RUN})
    (line,) = path.read_text().splitlines()
    notice = json.loads(line)
    assert notice["event"] == "promotion" and notice["data"]["version"] == 2
    run_prefix = f"{spec['artifact_root']}/{spec['name']}/{artifacts.safe_run_id(RUN)}"
    assert notice["data"]["report"] == f"{run_prefix}/report/report.html"


class Receiver(http.server.BaseHTTPRequestHandler):
    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.received.append({"path": self.path, "body": json.loads(body)})
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.received = []
    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_the_webhook_notifier_posts_text_and_fields_to_the_connections_url(
    tmp_path: Path, receiver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from operators.notifiers import notifiers

    conn = {"conn_type": "http", "host": receiver, "extra": {"endpoint": "/hooks/loraflow"}}
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_WEBHOOK", json.dumps(conn))
    spec = notify_spec(tmp_path, kind="webhook", connection="team_webhook")
    (notifier,) = notifiers(spec, "failure")
    notifier({"ti": FakeTI("lora_sft"), "run_id": RUN, "exception": RuntimeError("out of memory")})
    (post,) = Receiver.received
    assert post["path"] == "/hooks/loraflow"
    assert post["body"]["text"].startswith(f"Task lora_sft of {spec['name']} failed")
    assert post["body"]["loraflow"]["data"]["error"] == "RuntimeError: out of memory"


def test_webhook_urls_from_connection_fields() -> None:
    from types import SimpleNamespace

    from operators.notifiers import webhook_url

    def conn(**kw: Any) -> Any:
        return SimpleNamespace(**({"host": None, "port": None, "schema": None, "extra_dejson": {}} | kw))

    assert webhook_url(conn(host="https://hooks.example/T/B")) == "https://hooks.example/T/B"
    assert webhook_url(conn(host="10.0.0.1", port=8080, schema="http")) == "http://10.0.0.1:8080"
    assert webhook_url(conn(host="h", extra_dejson={"endpoint": "/a/b"})) == "https://h/a/b"


def test_notifiers_are_attached_to_the_dag(tmp_path: Path) -> None:
    import yaml

    from operators.dag_factory import load_pipelines
    from operators.notifiers import LoraflowNotifier

    data = load_spec(TINY).model_dump(mode="json") | {"notify": [{"kind": "file", "path": str(tmp_path / "n")}]}
    (tmp_path / "tiny-llama-lora.yaml").write_text(yaml.safe_dump(data))
    dag = load_pipelines(tmp_path)["tiny-llama-lora"]
    for task in dag.tasks:
        (callback,) = task.on_failure_callback
        assert isinstance(callback, LoraflowNotifier) and callback.event == "failure"
    (promotion,) = dag.get_task("publish").on_success_callback
    assert promotion.event == "promotion"
    assert not dag.get_task("gate").on_success_callback
