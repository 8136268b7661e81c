"""Load: eight concurrent runs of the tiny pipeline on a distributed Airflow, as production runs it: two
Celery workers of two task slots each with a PostgreSQL metadata database, started on 127.0.0.1 (PostgreSQL
installed from Debian packages when the machine lacks it): the distributed stack the end-to-end modules
share (tests/e2e/conftest.py). All succeed, no run touches another's artifacts, and runs with identical
inputs share the cache without corrupting it.

Two copies of the tiny pipeline (a DAG runs at most 4 runs at once) get four runs each with small
training_steps: six distinct settings, and one pair with identical inputs. validate_data,
convert_checkpoint and evaluate_base have identical inputs in all eight runs: the pair starts first and
computes them side by side (both racing for the same cache entries), the other six start once the pair
has committed them and take them from the cache, as a run started later would (started all at once, four
of the eight converted the same checkpoint, three of them for nothing); from there on the eight run
together. Takes ~10 minutes on 2 cores."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.dev.demo import LocalAirflow, prepare, say
from loraflow.dev.shared_stack import SharedStack
from loraflow.spec.schema import STAGES, load_spec
from loraflow.storage import artifacts, gcs

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
PIPELINES = ("tiny-load-a", "tiny-load-b")
# (pipeline, trigger conf); the first two runs have identical inputs. gate_min_improvement -1 makes
# the gate's decision rest on its interval alone, so publish (the shared registry) runs under load too.
RUNS = [
    ("tiny-load-a", {"training_steps": 10}),
    ("tiny-load-a", {"training_steps": 10}),
    ("tiny-load-a", {"training_steps": 12}),
    ("tiny-load-a", {"training_steps": 14}),
    ("tiny-load-b", {"training_steps": 11}),
    ("tiny-load-b", {"training_steps": 13}),
    ("tiny-load-b", {"training_steps": 15}),
    ("tiny-load-b", {"training_steps": 16}),
]
CACHED_STAGES = ("validate_data", "convert_checkpoint", "evaluate_base", "lora_sft", "merge_adapter", "evaluate_tuned")
# The stages whose inputs are the sources alone: the same cache key in all eight runs.
SOURCE_STAGES = ("validate_data", "convert_checkpoint", "evaluate_base")
PAIR = 2  # RUNS[:PAIR] have identical inputs and start first
ENDED = {"success", "failed", "skipped", "upstream_failed"}
# Four tasks at once (the stack's two workers of two slots): at most four vLLM / JAX processes (~1.5 GB each).
TASK_SLOTS = 4


# --------------------------------------------------------------------------------- the runs


def load_spec_copy(folder: Path, name: str) -> Path:
    text = TINY.read_text().replace("name: tiny-llama-lora", f"name: {name}")
    text += "\nretry:\n  retries: 2\n  delay_seconds: 5\n"
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


class Load:
    def __init__(self) -> None:
        self.runs: list[tuple[str, str, dict[str, Any]]] = []  # (dag, run id, conf)
        self.states: dict[str, str] = {}
        self.xcoms: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, dict[str, str | None]] = {}
        self.db_url = ""


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory, distributed_stack: SharedStack) -> Iterator[Load]:
    home = tmp_path_factory.mktemp("load")
    paths = [load_spec_copy(home, name) for name in PIPELINES]
    result = Load()
    airflow = distributed_stack.use(__name__, *paths)
    assert airflow.celery is not None and airflow.celery.count * airflow.celery.concurrency == TASK_SLOTS
    result.db_url = airflow.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    prepare(paths[0], home)  # both copies read the same sources
    for name in PIPELINES:
        airflow.wait_for_dag(name)
    for i, (dag, conf) in enumerate(RUNS):
        if i == PAIR:  # the others once the pair has committed the stages all eight share
            for pair_dag, pair_run, _ in result.runs:
                sources_done(airflow, pair_dag, pair_run)
        result.runs.append((dag, airflow.trigger(dag, {**conf, "gate_min_improvement": -1}), conf))
    for dag, run_id, _ in result.runs:
        result.states[run_id] = airflow.wait_for_run(dag, run_id, timeout=2400, progress=lambda _: None)
        result.tasks[run_id] = airflow.task_states(dag, run_id)
        result.xcoms[run_id] = {t: airflow.xcom(dag, run_id, t) for t in result.tasks[run_id]}
        say(f"{dag} {run_id}: {result.states[run_id]}")
    yield result


def sources_done(airflow: LocalAirflow, dag: str, run_id: str, timeout: float = 1200) -> None:
    """Wait until the run's SOURCE_STAGES have ended (or the run has: its tests then say why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = airflow.task_states(dag, run_id)
        if all(states.get(stage) in ENDED for stage in SOURCE_STAGES):
            return
        _, run = airflow.call("GET", f"/dags/{dag}/dagRuns/{run_id}")
        if isinstance(run, dict) and run.get("state") in ("success", "failed"):
            return
        time.sleep(2)
    raise AssertionError(f"{dag} {run_id}: {SOURCE_STAGES} did not end within {timeout:.0f} s")


def run_prefix(dag: str, run_id: str) -> str:
    return gcs.join(load_spec(TINY).artifact_root, dag, artifacts.safe_run_id(run_id))


def test_airflow_ran_on_postgresql(load: Load) -> None:
    import psycopg2

    assert load.db_url.startswith("postgresql+psycopg2://"), load.db_url
    dsn = load.db_url.replace("postgresql+psycopg2://", "postgresql://")
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        # this module's DAGs (the stack's other modules' runs are in the same database)
        cur.execute(
            "SELECT dag_id, state, count(*) FROM dag_run WHERE dag_id = ANY(%s) GROUP BY dag_id, state ORDER BY dag_id",
            (list(PIPELINES),),
        )
        rows = cur.fetchall()
    assert rows == [("tiny-load-a", "success", 4), ("tiny-load-b", "success", 4)], rows


def test_all_eight_concurrent_runs_succeed(load: Load) -> None:
    assert len(load.runs) == 8
    assert all(state == "success" for state in load.states.values()), load.tasks
    for run_id, tasks in load.tasks.items():
        assert set(tasks) == set(STAGES)
        assert all(s in ("success", "skipped") for s in tasks.values()), (run_id, tasks)


def test_no_run_touched_another_runs_artifacts(load: Load, tmp_path: Path) -> None:
    bucket_name, _ = gcs.split_uri(load_spec(TINY).artifact_root)
    for dag, run_id, conf in load.runs:
        prefix = run_prefix(dag, run_id)
        listed: set[str] = set()
        for stage, xcom in load.xcoms[run_id].items():
            if xcom is None:
                continue  # publish skipped by the gate
            manifest = artifacts.read_manifest(xcom["manifest"])
            artifacts.fetch(manifest, tmp_path / artifacts.safe_run_id(run_id) / stage)  # whole, verified
            if xcom["cached"]:
                assert not manifest.prefix.startswith(prefix + "/"), f"{stage} claims a cache hit on its own run"
            else:
                assert manifest.prefix == f"{prefix}/{stage}", (stage, manifest.prefix)
                listed |= {f"{manifest.prefix}/{n}" for n in manifest.files} | {manifest.uri}
            if stage == "lora_sft":
                assert manifest.data["config"]["steps"] == conf["training_steps"]
        # Everything under the run's prefix is this run's own committed output (or lora_sft's checkpoints).
        base = gcs.split_uri(prefix)[1]
        stored = {f"gs://{bucket_name}/{b.name}" for b in gcs.client().list_blobs(bucket_name, prefix=base + "/")}
        foreign = sorted(u for u in stored - listed if "/lora_sft/_checkpoints/" not in u)
        assert not foreign, f"{run_id}: objects no manifest of this run lists: {foreign}"


def test_identical_inputs_share_the_cache_without_corrupting_it(load: Load) -> None:
    spec = load_spec(TINY)
    a_run, b_run = load.runs[0][1], load.runs[1][1]
    a, b = load.xcoms[a_run], load.xcoms[b_run]
    for stage in CACHED_STAGES:
        ma, mb = artifacts.read_manifest(a[stage]["manifest"]), artifacts.read_manifest(b[stage]["manifest"])
        # Same inputs and config give the same key: sources by their bytes' fingerprint, upstream
        # stages by their own cache key (validate_data's bytes differ when two runs compute it at
        # once: Great Expectations' data docs carry a timestamp; its key does not).
        same_inputs = _input_identities(ma) == _input_identities(mb)
        assert (ma.data["cache_key"] == mb.data["cache_key"]) == same_inputs, stage
        # Whether both computed it at once or one reused the other's, the entry leads to one whole manifest.
        hit = artifacts.cache_lookup(spec.artifact_root, stage, ma.data["cache_key"])
        assert hit is not None and hit.uri in {ma.uri, mb.uri} | _all_manifests_for(load, stage), stage
    assert a["evaluate_tuned"]["summary"]["accuracy"] == b["evaluate_tuned"]["summary"]["accuracy"]
    # Every cache entry of every stage points at a whole manifest with its own key.
    bucket, base = gcs.split_uri(gcs.join(spec.artifact_root, "_cache"))
    entries = [blob.name for blob in gcs.client().list_blobs(bucket, prefix=base + "/")]
    keys: dict[str, set[str]] = {}
    for name in entries:
        stage, key = name[len(base) + 1 :].removesuffix(".json").split("/")
        manifest = artifacts.cache_lookup(spec.artifact_root, stage, key)
        assert manifest is not None, f"cache entry {name} does not lead to a whole manifest"
        keys.setdefault(stage, set()).add(key)
    # One key for the stages whose inputs are the sources themselves, in all eight runs.
    assert len(keys["validate_data"]) == len(keys["convert_checkpoint"]) == 1, keys
    say(f"cache keys per stage: { {k: len(v) for k, v in keys.items()} }")
    for stage in SOURCE_STAGES:
        computed = sum(1 for _, run_id, _ in load.runs if not load.xcoms[run_id][stage]["cached"])
        say(f"{stage} computed by {computed} of 8 runs, reused by the others")


def _input_identities(manifest: artifacts.Manifest) -> dict[str, str]:
    return {n: i.get("cache_key") or i["fingerprint"] for n, i in manifest.data["inputs"].items()}


def _all_manifests_for(load: Load, stage: str) -> set[str]:
    return {x[stage]["manifest"] for x in load.xcoms.values() if x.get(stage)}


def test_the_shared_registry_is_consistent(load: Load) -> None:
    spec = load_spec(TINY)
    for dag in PIPELINES:
        published = {r for d, r, _ in load.runs if d == dag and load.xcoms[r].get("publish")}
        bucket, base = gcs.split_uri(f"{spec.registry_uri}/{dag}/versions")
        entries = [json.loads(blob.download_as_bytes()) for blob in gcs.client().list_blobs(bucket, prefix=base + "/")]
        numbers = sorted(e["version"] for e in entries)
        assert numbers == list(range(1, len(numbers) + 1)), numbers  # no number taken twice, none lost
        registered = [e["run_id"] for e in entries]
        assert sorted(registered) == sorted(artifacts.safe_run_id(r) for r in published), (registered, published)
        say(f"{dag}: {len(numbers)} version(s) registered by {len(published)} promoted run(s)")
