"""The stack several end-to-end modules share (loraflow/dev/shared_stack.py, tests/e2e/conftest.py): which
specs it takes, when it asks the DAG processor to parse them, and the order that keeps it up only while the
modules that share it run. A stand-in Airflow answers the REST calls; the real one is tests/e2e's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev import shared_stack
from loraflow.dev.local_celery import CeleryWorkers
from loraflow.dev.shared_stack import SharedStack, together
from loraflow.errors import LoraflowError

REPO = Path(__file__).resolve().parents[2]
TINY = (REPO / "pipelines" / "tiny-llama-lora.yaml").read_text()


class StandInAirflow:
    """Answers GET /dags with each DAG's file token and records every call."""

    def __init__(self, dags: list[dict[str, str]]) -> None:
        self.dags = dags
        self.calls: list[tuple[str, str]] = []

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        self.calls.append((method, path))
        if method == "GET":
            return 200, {"dags": self.dags}
        return 201, None


def spec(folder: Path, name: str, root: str = "gs://loraflow-demo/artifacts", file: str = "") -> Path:
    text = TINY.replace("name: tiny-llama-lora", f"name: {name}")
    text = text.replace("artifact_root: gs://loraflow-demo/artifacts", f"artifact_root: {root}")
    path = folder / f"{file or name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SharedStack:
    """A shared stack whose local_stack is a stand-in: it notes the environment and specs it starts with,
    points this process at its emulator as local_stack does, and notes its stop."""
    s = SharedStack(tmp_path / "home", {"AIRFLOW__OPENLINEAGE__TRANSPORT": "file"})
    s.home.mkdir()
    seen: dict[str, Any] = {"starts": [], "stops": 0}

    @contextmanager
    def local_stack(
        home: Path,
        in_memory: bool,
        pipelines_dir: Path,
        database_url: str | None,
        celery: CeleryWorkers | None,
        env: dict[str, str],
    ) -> Iterator[StandInAirflow]:
        seen["starts"].append(
            (
                home,
                in_memory,
                env.get("AIRFLOW__OPENLINEAGE__TRANSPORT"),
                sorted(p.name for p in pipelines_dir.iterdir()),
            )
        )
        seen["database"], seen["celery"] = database_url, celery
        seen["environ"] = os.environ.get("AIRFLOW__OPENLINEAGE__TRANSPORT")
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{len(seen['starts'])}"
        try:
            yield StandInAirflow([{"fileloc": "/dags/loraflow_pipelines.py", "file_token": "tok-p"}])
        finally:
            seen["stops"] += 1

    monkeypatch.setattr(shared_stack, "local_stack", local_stack)
    monkeypatch.delenv("AIRFLOW__OPENLINEAGE__TRANSPORT", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    s.seen = seen  # type: ignore[attr-defined]
    return s


def test_modules_with_their_own_names_and_roots_share_one_start(stack: SharedStack, tmp_path: Path) -> None:
    a = stack.use("test_a", spec(tmp_path, "tiny-a"), spec(tmp_path, "tiny-a2"))  # one module, one root, two DAGs
    # started on its home, in memory, with the first module's specs in place
    assert stack.seen["starts"] == [(stack.home, True, "file", ["tiny-a.yaml", "tiny-a2.yaml"])]  # type: ignore[attr-defined]
    assert a.calls == []  # type: ignore[attr-defined]  # parsed as the stack starts: no reparse asked
    os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:2"  # another emulator started since
    b = stack.use("test_b", spec(tmp_path, "tiny-b", "gs://loraflow-demo/b-artifacts"))
    assert b is a and stack.starts == 1 and len(stack.seen["starts"]) == 1  # type: ignore[attr-defined]
    assert os.environ["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:1"  # this process points at the stack's again
    assert (stack.pipelines / "tiny-b.yaml").exists()
    assert a.calls == [("GET", "/dags?limit=1000"), ("PUT", "/parseDagFile/tok-p")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("before", [None, "console"])
def test_the_env_reaches_the_stack_only(
    stack: SharedStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    """The stack's processes take the env (local_stack's env); this process's environment never has it."""
    if before is not None:
        monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT", before)
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    assert stack.seen["starts"][0][2] == "file"  # type: ignore[attr-defined]
    assert stack.seen["environ"] == before  # type: ignore[attr-defined]  # not even while the stack starts
    assert os.environ.get("AIRFLOW__OPENLINEAGE__TRANSPORT") == before
    assert os.environ["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:1"  # what the stack's start set stays
    assert stack.seen["database"] is None and stack.seen["celery"] is None  # type: ignore[attr-defined]  # SQLite, LocalExecutor


def test_a_distributed_stack_starts_its_database_with_it_and_stops_it_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``database``, the stack starts that database as it starts (its URL to local_stack, with the
    Celery workers) and stops it after the stack, not before the first use."""
    events: list[str] = []

    @contextmanager
    def database() -> Iterator[str]:
        events.append("database up")
        try:
            yield "postgresql+psycopg2://airflow@127.0.0.1:5/airflow"
        finally:
            events.append("database down")

    @contextmanager
    def local_stack(**kwargs: Any) -> Iterator[StandInAirflow]:
        events.append(f"stack up on {kwargs['database_url']} with {kwargs['celery']}")
        try:
            yield StandInAirflow([])
        finally:
            events.append("stack down")

    monkeypatch.setattr(shared_stack, "local_stack", local_stack)
    workers = CeleryWorkers(count=3)
    s = SharedStack(tmp_path / "home", database=database, celery=workers)
    assert events == []
    s.use("test_a", spec(tmp_path, "tiny-a"))
    assert events == ["database up", f"stack up on postgresql+psycopg2://airflow@127.0.0.1:5/airflow with {workers}"]
    s.close()
    assert events[2:] == ["stack down", "database down"]


def test_an_artifact_root_of_another_module_is_refused(stack: SharedStack, tmp_path: Path) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    refusal = (
        "test_b's tiny-b.yaml has the artifact root gs://loraflow-demo/artifacts, which test_a's specs have in the "
        "shared stack: give it one of its own"
    )
    with pytest.raises(LoraflowError, match=re.escape(refusal)):
        stack.use("test_b", spec(tmp_path, "tiny-b", "gs://loraflow-demo/artifacts/"))  # the same root, a slash on
    assert not (stack.pipelines / "tiny-b.yaml").exists()  # nothing of a refused module reaches the stack


def test_a_module_may_share_the_root_of_the_module_it_takes_cached_stages_from(
    stack: SharedStack, tmp_path: Path
) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    stack.use("test_b", spec(tmp_path, "tiny-b"), cache_from="test_a")
    assert (stack.pipelines / "tiny-b.yaml").exists() and stack.owners == {"gs://loraflow-demo/artifacts": "test_a"}
    with pytest.raises(LoraflowError, match="which test_a's specs have"):  # only the module it names
        stack.use("test_c", spec(tmp_path, "tiny-c"), cache_from="test_b")


def test_a_file_name_already_in_the_stack_is_refused(stack: SharedStack, tmp_path: Path) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    with pytest.raises(LoraflowError, match=r"tiny-a\.yaml is in the shared stack already: give test_b's"):
        stack.use("test_b", spec(tmp_path, "tiny-a", "gs://loraflow-demo/b-artifacts"))  # the same DAG name


def test_reparse_asks_once_per_dag_file(stack: SharedStack, tmp_path: Path) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    airflow = stack.airflow
    airflow.dags = [  # type: ignore[union-attr]
        {"fileloc": "/dags/loraflow_pipelines.py", "file_token": "tok-p"},
        {"fileloc": "/dags/loraflow_pipelines.py", "file_token": "tok-p"},
        {"fileloc": "/dags/loraflow_registry.py", "file_token": "tok-r"},
    ]
    stack.reparse()
    puts = [path for method, path in airflow.calls if method == "PUT"]  # type: ignore[union-attr]
    assert sorted(puts) == ["/parseDagFile/tok-p", "/parseDagFile/tok-r"]


def test_close_lets_a_later_use_start_a_new_stack(stack: SharedStack, tmp_path: Path) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    stack.close()
    assert stack.airflow is None and stack.seen["stops"] == 1  # type: ignore[attr-defined]
    stack.close()  # closing a closed stack stops nothing twice
    assert stack.seen["stops"] == 1  # type: ignore[attr-defined]
    stack.use("test_b", spec(tmp_path, "tiny-b", "gs://loraflow-demo/b-artifacts"))
    assert stack.starts == 2 and os.environ["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:2"


def test_the_sharing_modules_run_one_after_another_where_the_first_was() -> None:
    modules = ["a", "a", "c", "d", "b", "e", "e", "f"]
    order = together(modules, {"a", "b", "e"})
    assert [modules[i] for i in order] == ["a", "a", "b", "e", "e", "c", "d", "f"]
    assert order == [0, 1, 4, 5, 6, 2, 3, 7]  # each module's tests in their own order
    assert together(["a", "c", "b"], {"a", "b"}) == [0, 2, 1]  # where the first one came, not later
    assert together(["a", "b", "a"], {"a", "b"}) == [0, 2, 1]  # a module's tests kept together
    assert together(modules, set()) == list(range(len(modules)))
    assert together(["c", "b", "a"], {"a", "b"}) == [0, 1, 2]


def test_a_module_that_takes_anothers_cached_stages_runs_right_after_it() -> None:
    modules = ["a", "a", "c", "b", "e", "e", "f"]
    order = together(modules, {"a", "b", "e"}, {"a": "b"})
    assert [modules[i] for i in order] == ["b", "a", "a", "e", "e", "c", "f"]  # where the group's first test came
    assert together(modules, {"a", "b", "e"}, {"a": "e"}) == [3, 4, 5, 0, 1, 2, 6]  # after e, not at the end
    assert together(modules, {"a", "b", "e"}, {"a": "x"}) == together(modules, {"a", "b", "e"})  # x not collected
    assert together(modules, {"a", "b"}, {"a": "e"}) == together(modules, {"a", "b"})  # e is not in the group


def test_emulator_env_names_what_local_stack_sets() -> None:
    from loraflow.dev import local_gcs

    assert set(shared_stack.EMULATOR_ENV) == set(local_gcs.Emulator("h", "b", None).env())  # type: ignore[arg-type]


def test_reparse_says_when_there_is_nothing_to_reparse_or_it_is_refused(
    stack: SharedStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    airflow = stack.airflow
    airflow.dags = [{"fileloc": "/dags/loraflow_pipelines.py"}]  # type: ignore[union-attr]  # no token (yet)
    with pytest.raises(LoraflowError, match=r"lists no DAG to reparse \(HTTP 200: \{'dags': "):
        stack.reparse(timeout=0)
    airflow.dags = [{"fileloc": "/dags/loraflow_pipelines.py", "file_token": "tok-p"}]  # type: ignore[union-attr]
    airflow.call = lambda method, path, body=None: (200, {"dags": airflow.dags}) if method == "GET" else (403, "no")  # type: ignore[union-attr]
    monkeypatch.setattr(shared_stack.time, "sleep", lambda s: pytest.fail("a refusal (4xx) was asked again"))
    with pytest.raises(LoraflowError, match=r"the reparse request was refused \(HTTP 403: no\)"):
        stack.reparse()


def test_reparse_asks_again_while_the_server_fails_and_names_the_last_failure(
    stack: SharedStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack.use("test_a", spec(tmp_path, "tiny-a"))
    airflow = stack.airflow
    answers = [(500, "locked"), (503, "busy"), (201, None)]
    puts: list[str] = []

    def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        if method == "GET":
            return 200, {"dags": airflow.dags}  # type: ignore[union-attr]
        puts.append(path)
        return answers.pop(0) if answers else (500, "still locked")

    airflow.call = call  # type: ignore[union-attr]
    sleeps: list[float] = []
    monkeypatch.setattr(shared_stack.time, "sleep", sleeps.append)
    stack.reparse()
    assert puts == ["/parseDagFile/tok-p"] * 3 and sleeps == [2, 2]
    with pytest.raises(LoraflowError, match=r"the reparse request was refused \(HTTP 500: still locked\)"):
        stack.reparse(timeout=0)  # past the deadline: the failure, not another try
    assert len(puts) == 4


def test_leaving_the_with_block_stops_the_stack_it_started(stack: SharedStack, tmp_path: Path) -> None:
    with stack as same:
        assert same is stack
        stack.use("test_a", spec(tmp_path, "tiny-a"))
        assert stack.seen["stops"] == 0  # type: ignore[attr-defined]
    assert stack.airflow is None and stack.seen["stops"] == 1  # type: ignore[attr-defined]
