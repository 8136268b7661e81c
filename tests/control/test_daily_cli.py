"""The ``loraflow`` daily-work commands: registry, verify (against the GCS emulator), trigger's param
check (against the Params Airflow reports for the real DAGs), and the one-line errors when Airflow or
GCS cannot be reached."""

from __future__ import annotations

import json
import math
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from loraflow import cli
from loraflow.cli.airflow_rest import AirflowClient
from loraflow.cli.dag_params import conf_from
from loraflow.dev.local_gcs import free_port
from loraflow.errors import LoraflowError
from loraflow.storage import gcs

from .champions import committed_model, register_champion
from .test_registry_dag import spec_folder

TINY = "tiny-llama-lora"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def folder(gcs_bucket: str, tmp_path: Path) -> Path:
    """The tiny spec's folder; its registry holds versions 1 and 2, 2 the champion."""
    found = spec_folder(tmp_path, gcs_bucket)
    root = f"{gcs_bucket}/artifacts"
    for n in (1, 2):
        register_champion(
            f"{root}/_registry", root, tmp_path, accuracy=0.5 + n / 10, pipeline=TINY, run=f"run-{n}", version=n
        )
    return found


def test_registry_commands_list_roll_back_and_promote(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFLOW_ACTOR", "carol")
    rc, out, _ = run(capsys, "registry", "list", TINY, "--pipelines", str(folder))
    assert rc == 0 and "champion: version 2" in out and "accuracy=0.7" in out and "run-1" in out
    rc, out, _ = run(capsys, "registry", "rollback", TINY, "--pipelines", str(folder), "--reason", "worse on prod")
    assert rc == 0 and 'rollback v2 -> v1  by carol (cli): "worse on prod"' in out
    rc, out, _ = run(capsys, "registry", "list", TINY, "--pipelines", str(folder), "--json")
    listed = json.loads(out)
    assert listed["champion"] == 1 and [e["actor"] for e in listed["audit"]] == ["carol"]
    rc, out, err = run(capsys, "registry", "promote", TINY, "7", "--pipelines", str(folder), "--reason", "r")
    assert rc == 1 and out == "" and err.startswith("error: tiny-llama-lora has no registry version 7 (versions: 1, 2)")
    rc, out, _ = run(
        capsys, "registry", "promote", TINY, "2", "--pipelines", str(folder), "--reason", "fixed", "--actor", "dan"
    )
    assert rc == 0 and "promote  v1 -> v2  by dan (cli)" in out


def test_a_move_without_a_reason_is_a_usage_error(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["registry", "rollback", TINY, "--pipelines", str(folder)])
    assert exit_.value.code == 2 and "--reason" in capsys.readouterr().err


def test_an_unknown_pipeline_names_the_ones_there_are(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "registry", "list", "tiny", "--pipelines", str(folder))
    assert rc == 1 and "no pipeline 'tiny' in" in err and "its pipelines: tiny-llama-lora" in err


def test_verify_checks_every_file_against_the_manifest(
    gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = committed_model(gcs_bucket, "p", "run-1", tmp_path, payload=b"weights")
    rc, out, _ = run(capsys, "verify", model.prefix)
    assert rc == 0 and out.startswith(f"ok: 1 file(s) of merge_adapter at {model.prefix} match")
    rc, out, _ = run(capsys, "verify", model.uri, "--download")
    assert rc == 0 and "downloaded and checksummed" in out
    bucket, path = gcs.split_uri(model.prefix + "/model.safetensors")
    gcs.client().bucket(bucket).blob(path).upload_from_string(b"weightz")  # same size, other bytes
    rc, _, err = run(capsys, "verify", model.prefix)
    assert rc == 1 and "model.safetensors: crc32c" in err and "the manifest says" in err
    gcs.client().bucket(bucket).blob(path).delete()
    rc, _, err = run(capsys, "verify", model.prefix)
    assert rc == 1 and "model.safetensors: listed in the manifest, missing from GCS" in err
    rc, _, err = run(capsys, "verify", f"{gcs_bucket}/nothing-here")
    assert rc == 1 and "error: no committed artifact at" in err


def test_gcs_that_cannot_be_reached_is_one_line_naming_the_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    host = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
    rc, _, err = run(capsys, "verify", "gs://b/p/run/merge_adapter")
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith(f"error: cannot reach GCS at {host} (STORAGE_EMULATOR_HOST)")


def test_airflow_that_cannot_be_reached_is_one_line_naming_the_url_and_the_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("LORAFLOW_AIRFLOW_USERNAME", "admin")
    monkeypatch.setenv("LORAFLOW_AIRFLOW_PASSWORD", "s3cret-never-shown")
    for argv in (["runs", TINY], ["trigger", TINY, "--param", "training_steps=100"]):
        rc, out, err = run(capsys, *argv, "--airflow-url", url)
        assert rc == 1 and out == "" and err.count("\n") == 1
        assert err.startswith(f"error: cannot reach Airflow at {url}") and "LORAFLOW_AIRFLOW_URL" in err
        assert "s3cret" not in err
    monkeypatch.delenv("LORAFLOW_AIRFLOW_PASSWORD")
    rc, _, err = run(capsys, "runs", TINY, "--airflow-url", url)
    assert (
        rc == 1
        and "set LORAFLOW_AIRFLOW_TOKEN (a JWT), or LORAFLOW_AIRFLOW_USERNAME and LORAFLOW_AIRFLOW_PASSWORD" in err
    )


@pytest.fixture
def not_http() -> Iterator[str]:
    """A port that accepts a connection and answers with something that is not HTTP (an SSH banner)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:  # as an SSH server: its banner first, then it reads what comes until the client leaves
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.settimeout(5)
                try:
                    while conn.recv(4096):
                        pass
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


def assert_one_line(rc: int, out: str, err: str, *says: str) -> None:
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    for words in says:
        assert words in err, err


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://[::1", "the Airflow URL 'http://[::1' cannot be read (Invalid IPv6 URL)"),
        ("http://127.0.0.1:99999", "the Airflow URL 'http://127.0.0.1:99999' cannot be read (Port out of range"),
        ("127.0.0.1:8080", "the Airflow URL '127.0.0.1:8080' is not an http:// or https:// URL of a host"),
        ("http://127.0.0.1:8080/a b", "is not an http:// or https:// URL of a host"),
    ],
)
def test_an_airflow_url_that_is_no_url_is_one_line_saying_what_to_write(
    url: str, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFLOW_AIRFLOW_TOKEN", "jwt")
    for argv in (["runs", TINY], ["trigger", TINY, "-p", "training_steps=100"]):
        assert_one_line(*run(capsys, *argv, "--airflow-url", url), says, "such as http://127.0.0.1:8080")
    monkeypatch.setenv("LORAFLOW_AIRFLOW_URL", url)
    assert_one_line(*run(capsys, "runs", TINY), says, "LORAFLOW_AIRFLOW_URL")


def test_an_airflow_url_whose_port_answers_no_http_is_one_line(
    not_http: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFLOW_AIRFLOW_USERNAME", "admin")
    monkeypatch.setenv("LORAFLOW_AIRFLOW_PASSWORD", "pw")
    says = f"what answers at {not_http} is not an HTTP server (BadStatusLine); point --airflow-url"
    assert_one_line(*run(capsys, "runs", TINY, "--airflow-url", not_http), says)


def test_an_http_server_that_is_not_airflow_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Page(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>a web page</html>")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("LORAFLOW_AIRFLOW_TOKEN", "jwt")
    try:
        for argv in (["runs", TINY], ["trigger", TINY]):
            says = f"{url} answered GET /dags/{TINY}/details with no JSON object ('<html>a web page</html>')"
            assert_one_line(*run(capsys, *argv, "--airflow-url", url), says, "Airflow's API server")
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("host", "says"),
    [
        ("http://127.0.0.1:99999", "STORAGE_EMULATOR_HOST 'http://127.0.0.1:99999' cannot be read (Port out of range"),
        ("http://[::1", "STORAGE_EMULATOR_HOST 'http://[::1' cannot be read (Invalid IPv6 URL)"),
        ("localhost:abc", "STORAGE_EMULATOR_HOST 'localhost:abc' cannot be read (Port could not be cast"),
        ("ftp://127.0.0.1:21", "STORAGE_EMULATOR_HOST 'ftp://127.0.0.1:21' is not an http:// URL of a host"),
    ],
)
def test_an_emulator_host_that_cannot_be_read_is_one_line_saying_what_to_set(
    host: str, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
    assert_one_line(*run(capsys, "verify", "gs://bucket/p/run/merge_adapter"), says, "such as http://127.0.0.1:4443")


def test_an_emulator_port_that_answers_no_http_is_one_line_at_once(
    not_http: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client library retried for 120 s before its traceback."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", not_http)
    says = f"what answers at {not_http} (STORAGE_EMULATOR_HOST) is not an HTTP server (BadStatusLine)"
    assert_one_line(*run(capsys, "verify", "gs://bucket/p/run/merge_adapter"), says)


@pytest.mark.parametrize("bucket", ["Bad_Bucket!", "UPPER", "-dash", "a..b"])
def test_verify_of_a_bucket_gcs_never_allows_is_one_line_naming_the_rule(
    bucket: str, gcs_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    says = f"error: 'gs://{bucket}/x': '{bucket}' is not a GCS bucket name; use 3-63 lowercase letters"
    assert_one_line(*run(capsys, "verify", f"gs://{bucket}/x"), says)


@pytest.fixture(scope="module")
def dumped_params() -> dict[str, dict[str, Any]]:
    """DAG id -> its params exactly as Airflow's REST API reports them (``Param.dump()`` of each)."""
    from loraflow.spec.locate import pipelines_dir
    from operators.dag_factory import load_pipelines
    from operators.registry import registry_dag

    dags = {**load_pipelines(pipelines_dir()), "loraflow_registry": registry_dag(pipelines_dir())}
    return {
        dag_id: json.loads(json.dumps({k: v.dump() for k, v in dag.params.items()}, default=str))
        for dag_id, dag in dags.items()
    }


def test_trigger_params_are_read_as_their_types_and_checked(dumped_params: dict) -> None:
    params = dumped_params[TINY]
    conf = conf_from(TINY, params, ["training_steps=100", "training_learning_rate=0.001", "lora_rank=8"])
    assert conf == {"training_steps": 100, "training_learning_rate": 0.001, "lora_rank": 8}
    registry = dumped_params["loraflow_registry"]
    conf = conf_from("loraflow_registry", registry, ["action=rollback", f"pipeline={TINY}", "reason=123"])
    assert conf["reason"] == "123"  # a string param keeps the text as given


def test_every_bad_trigger_param_is_named_with_what_it_allows(dumped_params: dict) -> None:
    with pytest.raises(LoraflowError) as refused:
        conf_from(TINY, dumped_params[TINY], ["training_step=100", "lora_rank=500", "training_learning_rate=fast"])
    message = str(refused.value)
    assert "'training_step' is no param of this DAG" in message and "did you mean 'training_steps'?" in message
    assert "param 'lora_rank' = 500 breaks its maximum 64" in message
    assert "param 'training_learning_rate' = 'fast' is not of type number" in message
    with pytest.raises(
        LoraflowError, match=r"'delete' is not one of the allowed values: \"list\", \"promote\", \"rollback\""
    ):
        conf_from("loraflow_registry", dumped_params["loraflow_registry"], ["action=delete"])
    with pytest.raises(LoraflowError, match=r"'oops' is not KEY=VALUE"):
        conf_from(TINY, dumped_params[TINY], ["oops"])


class _AirflowApi:
    """Answers the token and DAG-details requests with real Params; records every trigger (a POST)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params, self.posts = params, []  # type: ignore[var-annotated]
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/auth/token":
                    return self._send(201, {"access_token": "jwt"})
                api.posts.append(self.path)
                return self._send(200, {"dag_run_id": "manual__1", "state": "queued"})

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != "Bearer jwt":
                    return self._send(401, {"detail": "Not authenticated"})
                if self.path == f"/api/v2/dags/{TINY}/details":
                    return self._send(200, {"dag_id": TINY, "is_paused": True, "params": api.params})
                return self._send(404, {"detail": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api(dumped_params: dict, monkeypatch: pytest.MonkeyPatch) -> Iterator[_AirflowApi]:
    monkeypatch.setenv("LORAFLOW_AIRFLOW_USERNAME", "admin")
    monkeypatch.setenv("LORAFLOW_AIRFLOW_PASSWORD", "pw")
    served = _AirflowApi(dumped_params[TINY])
    yield served
    served.server.shutdown()


def test_trigger_refuses_a_bad_param_before_triggering_anything(
    api: _AirflowApi, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(capsys, "trigger", TINY, "-p", "training_steps=5", "--airflow-url", api.url)
    assert rc == 1 and "param 'training_steps' = 5 breaks its minimum 10" in err and api.posts == []
    rc, out, _ = run(capsys, "trigger", TINY, "-p", "training_steps=50", "--airflow-url", api.url)
    assert rc == 0 and "run manual__1" in out and '{"training_steps": 50}' in out
    assert "is paused" in out and api.posts == [f"/api/v2/dags/{TINY}/dagRuns"]


@pytest.mark.parametrize("written", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_trigger_refuses_nan_and_infinity_before_posting(
    written: str, api: _AirflowApi, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-p training_learning_rate=NaN`` passed the check (a NaN breaks no bound) and was posted as
    invalid JSON."""
    rc, out, err = run(capsys, "trigger", TINY, "-p", f"training_learning_rate={written}", "--airflow-url", api.url)
    says = f"param 'training_learning_rate' = '{written}' is not a finite number (JSON has no NaN or Infinity)"
    assert_one_line(rc, out, err, says, "write a number")
    assert api.posts == []


def test_no_request_body_with_nan_or_infinity_is_sent(api: _AirflowApi) -> None:
    client = AirflowClient.from_settings(api.url)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(LoraflowError, match="the request holds NaN or Infinity, which JSON has no value for"):
            client.call("POST", f"/dags/{TINY}/dagRuns", {"conf": {"training_learning_rate": bad}})
    assert api.posts == []


# ------------------------------------------------------------------------------ boundaries


def test_a_reason_of_the_documented_maximum_is_recorded_and_one_more_character_refused(
    folder: Path, capsys: pytest.CaptureFixture[str], dumped_params: dict
) -> None:
    """1,000 characters is the documented maximum (the CLI, the audit trail and the maintenance DAG's param)."""
    longest = "r" * 999 + "!"
    rc, out, err = run(capsys, "registry", "rollback", TINY, "--pipelines", str(folder), "--reason", longest + "?")
    assert_one_line(rc, out, err, "the reason has 1001 characters; an audit event keeps at most 1000: shorten it")
    rc, _, _ = run(capsys, "registry", "rollback", TINY, "--pipelines", str(folder), "--reason", longest)
    assert rc == 0
    rc, out, _ = run(capsys, "registry", "list", TINY, "--pipelines", str(folder), "--json")
    assert [e["reason"] for e in json.loads(out)["audit"]] == [longest]
    registry = dumped_params["loraflow_registry"]
    assert conf_from("loraflow_registry", registry, [f"reason={longest}"])["reason"] == longest
    with pytest.raises(LoraflowError, match=r"param 'reason' = .* is longer than its maxLength 1000"):
        conf_from("loraflow_registry", registry, [f"reason={longest}?"])


def test_a_param_value_keeps_every_equals_sign_after_the_first(dumped_params: dict) -> None:
    registry = dumped_params["loraflow_registry"]
    conf = conf_from("loraflow_registry", registry, ["reason=a=b", f"pipeline={TINY}", "action=rollback"])
    assert conf == {"reason": "a=b", "pipeline": TINY, "action": "rollback"}
    assert conf_from("loraflow_registry", registry, ["reason==x="])["reason"] == "=x="
