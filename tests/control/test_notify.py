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
from loraflow.reporting import notify
from loraflow.spec.schema import load_spec, validate_spec
from loraflow.storage import artifacts
from loraflow.storage.summaries import GateSummary, PublishSummary

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
    summary = {"promote": True, "base": 0.5, "tuned": 0.9125, "ci": [0.36, 0.46], "confidence": 0.9,
               "reason": "gain +0.41 clears 0.30"}  # fmt: skip
    decision = GateSummary.from_object(summary, "gate")
    published = PublishSummary(True, 4, "gs://a/merge_adapter/_MANIFEST.json")
    m = notify.promotion("tiny", RUN, published, decision, "gs://a/report/report.html")
    assert m.subject == "[loraflow] tiny: model version 4 promoted"
    assert "Metric before: 0.500, after: 0.912, 90% interval of the gain [+0.360, +0.460]." in m.text
    assert "Gate: gain +0.41 clears 0.30" in m.text and "Report: gs://a/report/report.html" in m.text
    assert m.data["version"] == 4 and m.data["tuned"] == 0.9125
    older = notify.promotion("tiny", RUN, published, GateSummary.from_object({**summary, "confidence": None}, "gate"))
    assert "Metric before: 0.500, after: 0.912, interval of the gain [+0.360, +0.460]." in older.text  # no level said


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


def test_a_promotion_notice_gives_the_level_this_runs_gate_used(tmp_path: Path) -> None:
    """A run triggered with another gate.confidence (a declared param) was announced with the DAG spec's 95%."""
    from operators.notifiers import notifiers

    path = tmp_path / "notices.jsonl"
    spec = notify_spec(tmp_path, kind="file", path=str(path))
    assert spec["gate"]["confidence"] == 0.95
    (notifier,) = notifiers(spec, "promotion")
    gate = {
        "summary": {"promote": True, "base": 0.5, "tuned": 0.9, "ci": [0.3, 0.5], "confidence": 0.8, "reason": "ok"}
    }
    published = {"summary": {"promoted": True, "version": 2, "model_manifest": "gs://m/_MANIFEST.json"}}
    notifier({"ti": FakeTI("publish", {"publish": published, "gate": gate}), "run_id": RUN})
    assert "80% interval of the gain [+0.300, +0.500]" in json.loads(path.read_text())["text"]


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


# ------------------------------------------------------------------------------------ dataset strings in notices

# A role a data team (or anyone who writes a dataset version) can put in a row: a Slack broadcast, a
# disguised link, a line that reads like loraflow's own, a right-to-left override; 2 MB of it.
HOSTILE = "<!channel> <https://evil.example|Re-authenticate> & ping\nModel version 99 was promoted.\u202e"
HOSTILE_ROLE = HOSTILE + "x" * 2_000_000


def _rejected_by_the_loader(tmp_path: Path) -> list[str]:
    """The data-contract reasons validate_data records for a train file whose role is HOSTILE_ROLE."""
    from loraflow.data import dataset as ds
    from loraflow.errors import DataValidationError

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [{"role": HOSTILE_ROLE, "content": "hi"}]}) + "\n")
    with pytest.raises(DataValidationError) as err:
        ds.load(path, id_prefix="train-")
    return [f"train: {err.value}"]


def test_a_dataset_string_reaches_every_sink_quoted_for_it_and_capped(
    tmp_path: Path, gcs_bucket: str, receiver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5 of issue 29: the role went verbatim into _RESULT.json, the asset event's extra, the file
    notice and the webhook (6 MB, a live @channel and a disguised link in Slack). Each sink now gets it
    quoted as that sink needs and capped."""
    from loraflow.pipeline import handoff
    from operators.notifiers import notifiers

    # What validate_data leaves for a rejected dataset, and the verdict task's documents built from it.
    run = f"{gcs_bucket}/artifacts/tiny-handoff/run1"
    artifacts.write_json(
        f"{run}/validate_data/_rejected/data_report.json", {"load_problems": _rejected_by_the_loader(tmp_path)}
    )
    data = load_spec(TINY).model_dump(mode="json") | {
        "name": "tiny-handoff",
        "handoff": {"prefix": f"{gcs_bucket}/team"},
    }
    del data["data"]["train"], data["data"]["eval"]
    spec = validate_spec(data, "test")
    verdict, reasons = handoff.judge({"validate_data": "failed"}, handoff.data_failures(run), None, None)
    document = handoff.result_document(spec, "tiny-handoff", RUN, "v1", verdict, reasons, None, None, None, None)
    result_uri = handoff.write_result(spec, "v1", document)
    extra = handoff.event_extra(document, result_uri)

    # JSON sinks (_RESULT.json, the asset event's extra): still JSON, the value as read, but capped.
    stored = artifacts.read_json(result_uri)
    assert stored["verdict"] == "rejected" and HOSTILE[:40] in stored["reasons"][0]
    assert len(json.dumps(stored)) < 16 * 1024 and len(json.dumps(extra)) < 8 * 1024
    assert HOSTILE[:40] in extra["reasons"][0]

    # The file notice: JSON, and its text plain: the dataset's line break cannot start a line of its own.
    notices = tmp_path / "notices.jsonl"
    (file_notifier,) = notifiers(notify_spec(tmp_path, kind="file", path=str(notices), events=["verdict"]), "verdict")
    context = {"ti": FakeTI(handoff.VERDICT_TASK, {handoff.VERDICT_TASK: {"result": result_uri}}), "run_id": RUN}
    file_notifier(context)
    (line,) = notices.read_text().splitlines()
    assert len(line) < 32 * 1024
    notice = json.loads(line)
    assert "Model version 99" in notice["text"]
    assert not any(row.startswith("Model version 99") for row in notice["text"].splitlines())
    assert "\u202e" not in notice["text"] and "\\u202e" in notice["text"]

    # The webhook (Slack mrkdwn): &, < and > escaped as Slack documents, so no mention and no link.
    conn = {"conn_type": "http", "host": receiver, "extra": {"endpoint": "/hooks/loraflow"}}
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_WEBHOOK", json.dumps(conn))
    (webhook,) = notifiers(
        notify_spec(tmp_path, kind="webhook", connection="team_webhook", events=["verdict"]), "verdict"
    )
    webhook(context)
    (post,) = Receiver.received
    assert len(json.dumps(post["body"])) < 32 * 1024
    text = post["body"]["text"]
    assert "&lt;!channel&gt; &lt;https://evil.example|Re-authenticate&gt; &amp; ping" in text
    assert "<" not in text and ">" not in text and "&ping" not in text
    assert not any(row.startswith("Model version 99") for row in text.splitlines())
    assert text.startswith(f"Dataset {gcs_bucket}/team/v1 was rejected by tiny-handoff")


@pytest.mark.parametrize("char", ["&", "<", '"', "\\", "\x00", "\u202e", "\U0001f600", "\ud800", "é"])
def test_every_sink_stays_within_its_size_whatever_the_characters(char: str) -> None:
    """The caps hold for the characters that grow most when escaped (JSON's \\u escapes, Slack's &amp;)."""
    value = char * 300_000
    result = {"pipeline": "p", "run_id": "r", "dataset": "gs://b/v", "version": "v", "verdict": "rejected"}
    message = notify.verdict(result | {"reasons": [value] * 50, "report": value}, "gs://b/v/_RESULT.json")
    body = notify.webhook_body(message)
    assert len(body) <= notify.MAX_JSON_BYTES and json.loads(body)["loraflow"]["event"] == "verdict"
    assert len(message.to_json()) <= notify.MAX_JSON_BYTES
    assert len(json.dumps(notify.capped_json({"a": [value] * 100, "b": {"c": value}}, 4096))) <= 4096
    assert len(json.dumps(notify.capped_json([[[[[[[[value]]]]]]]], 1024))) <= 1024
    failure = notify.failure("p", "r", "gate", value)
    assert (
        len(failure.text) < notify.MAX_ERROR_CHARS + 200 and len(notify.webhook_body(failure)) <= notify.MAX_JSON_BYTES
    )


def test_slack_text_escapes_its_three_control_characters_and_a_cut_never_splits_an_escape() -> None:
    assert notify.slack_mrkdwn("<!here> a & b <@U123> <https://x|y>") == (
        "&lt;!here&gt; a &amp; b &lt;@U123&gt; &lt;https://x|y&gt;"
    )
    for limit in range(4, 40):
        cut = notify.slack_mrkdwn("<" * 100, limit)
        assert len(cut) <= limit and cut.endswith("...") and set(cut[:-3].replace("&lt;", "")) == set()


def test_plain_text_is_one_line_with_invisible_characters_shown() -> None:
    assert notify.plain_text("a\nb\r\n\tc\u2028d") == "a b c d"
    assert notify.plain_text("x\x1b[31my\u200bz\u202e") == "x\\x1b[31my\\u200bz\\u202e"
    assert notify.plain_text("y" * 1000, 20) == "y" * 17 + "..."


def test_json_sinks_keep_json_and_say_what_was_left_out() -> None:
    capped = notify.capped_json({"n": float("nan"), "i": float("-inf"), "ok": 0.5, "l": list(range(100))}, 400)
    assert capped["n"] == "nan" and capped["i"] == "-inf" and capped["ok"] == 0.5
    assert capped["l"][-1].startswith("... and ") and len(json.dumps(capped)) <= 400
    assert notify.capped_reasons(["r"] * 12) == ["r"] * notify.MAX_REASONS + ["... and 2 more"]
