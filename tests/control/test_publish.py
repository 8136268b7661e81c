"""publish.run against the GCS emulator (the ``gcs_bucket`` fixture of tests/conftest.py).

The emulator (fake-gcs-server) enforces ``ifGenerationMatch`` as GCS does, so "never take a taken
number" and "never clobber a moved alias" are decided by the store's preconditions, as in production.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError, LoraflowError
from loraflow.steps import publish
from loraflow.storage import artifacts, gcs

from . import champions


def committed_model(root: str, tmp_path: Path, run: str = "run-1", payload: bytes = b"weights") -> artifacts.Manifest:
    """A committed merge_adapter artifact (a stand-in for the merged checkpoint)."""
    local = tmp_path / f"model-{run}"
    local.mkdir()
    (local / "model.safetensors").write_bytes(payload)
    (local / "config.json").write_text("{}")
    prefix = gcs.join(root, "artifacts", "tiny", run, "merge_adapter")
    files = artifacts.upload_tree(local, prefix)
    return artifacts.commit(
        prefix, files, stage="merge_adapter", inputs={}, config={}, lock_version="t", cache_key="", summary={}
    )


def decision_dir(tmp_path: Path, promote: bool, name: str = "decision") -> Path:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    reason = (
        "accuracy rose by +0.650" if promote else "accuracy rose by +0.000, less than the required +0.300; not promoted"
    )
    (d / "decision.json").write_text(
        json.dumps({"promote": promote, "delta": 0.65 if promote else 0.0, "reason": reason})
    )
    return d


def read(uri: str) -> dict:
    data = artifacts.read_json(uri)
    assert data is not None, f"{uri} is missing"
    return data


@pytest.fixture
def publish_run(gcs_bucket: str, tmp_path: Path, make_ctx: Callable) -> Callable:
    def run(model: artifacts.Manifest, promote: bool, run_id: str, as_ref: bool = False):  # type: ignore[no-untyped-def]
        config = {"registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny", "run_id": run_id}
        manifests = {}
        if as_ref:
            manifests["model"] = model
        else:
            config["model_manifest"] = model.uri
        ctx = make_ctx("publish", {"decision": decision_dir(tmp_path, promote, f"d-{run_id}")}, config, manifests)
        return publish.run(ctx), ctx

    return run


def test_promoted_model_gets_a_version_and_the_alias(gcs_bucket: str, tmp_path: Path, publish_run: Callable) -> None:
    model = committed_model(gcs_bucket, tmp_path)
    summary, ctx = publish_run(model, True, "run-1")
    assert summary == {"promoted": True, "version": 1, "model_manifest": model.uri}

    version = read(f"{gcs_bucket}/_registry/tiny/versions/0001.json")
    assert version["model_manifest"] == model.uri
    assert version["model_fingerprint"] == model.fingerprint
    assert version["run_id"] == "run-1" and version["decision"]["promote"] is True and version["created_at"]
    alias = read(f"{gcs_bucket}/_registry/tiny/aliases/champion.json")
    assert alias["version"] == 1 and alias["model_manifest"] == model.uri
    entry = json.loads((ctx.out / "registry_entry.json").read_text())
    assert entry["promoted"] is True and entry["version_uri"].endswith("/tiny/versions/0001.json")


def test_next_run_takes_the_next_number_and_moves_the_alias(
    gcs_bucket: str, tmp_path: Path, publish_run: Callable
) -> None:
    first = committed_model(gcs_bucket, tmp_path, "run-1", b"one")
    second = committed_model(gcs_bucket, tmp_path, "run-2", b"two")
    publish_run(first, True, "run-1")
    summary, _ = publish_run(second, True, "run-2", as_ref=True)  # model given as a --ref input
    assert summary["version"] == 2
    assert read(f"{gcs_bucket}/_registry/tiny/versions/0001.json")["model_manifest"] == first.uri  # untouched
    alias = read(f"{gcs_bucket}/_registry/tiny/aliases/champion.json")
    assert alias["version"] == 2 and alias["model_fingerprint"] == second.fingerprint


def test_a_retried_publish_reuses_its_version(gcs_bucket: str, tmp_path: Path, publish_run: Callable) -> None:
    model = committed_model(gcs_bucket, tmp_path)
    publish_run(model, True, "run-1")
    summary, _ = publish_run(model, True, "run-1")
    assert summary["version"] == 1
    assert sorted(publish.Registry(f"{gcs_bucket}/_registry", "tiny").versions()) == [1]


def test_not_promoted_registers_nothing(gcs_bucket: str, tmp_path: Path, publish_run: Callable) -> None:
    model = committed_model(gcs_bucket, tmp_path)
    summary, ctx = publish_run(model, False, "run-1")
    assert summary == {"promoted": False, "version": None, "model_manifest": model.uri}
    assert publish.Registry(f"{gcs_bucket}/_registry", "tiny").versions() == {}
    assert artifacts.read_json(f"{gcs_bucket}/_registry/tiny/aliases/champion.json") is None
    entry = json.loads((ctx.out / "registry_entry.json").read_text())
    assert entry["promoted"] is False and "not promoted" in entry["reason"]


def test_a_lost_race_takes_the_next_number_and_never_overwrites(
    gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = publish.Registry(f"{gcs_bucket}/_registry", "race")
    number, _ = registry.register({"run_id": "other-publisher"})
    assert number == 1
    # This publisher listed the versions before the other one wrote 0001: its listing is stale.
    real = publish.Registry.versions
    calls = {"n": 0}

    def stale_first(self):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return {} if calls["n"] == 1 else real(self)

    monkeypatch.setattr(publish.Registry, "versions", stale_first)
    number, data = registry.register({"run_id": "me"})
    assert number == 2 and data["run_id"] == "me"
    assert read(registry.version_uri(1))["run_id"] == "other-publisher"


def test_concurrent_alias_writer_is_detected(gcs_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = publish.Registry(f"{gcs_bucket}/_registry", "alias-race")
    entry = {"model_manifest": "gs://b/m/_MANIFEST.json", "model_fingerprint": "f", "run_id": "r"}
    registry.move_alias(1, entry)
    # Another publisher moves the alias to 5 between our read and our write: we must not clobber it.
    real_get = type(registry.bucket).get_blob
    state = {"raced": False}

    def get_blob(self, name, *args, **kwargs):  # type: ignore[no-untyped-def]
        blob = real_get(self, name, *args, **kwargs)
        if name.endswith("champion.json") and not state["raced"]:
            state["raced"] = True
            other = publish.Registry(f"{gcs_bucket}/_registry", "alias-race")
            monkeypatch.setattr(type(registry.bucket), "get_blob", real_get)
            other.move_alias(5, entry)
            monkeypatch.setattr(type(registry.bucket), "get_blob", get_blob)
        return blob

    monkeypatch.setattr(type(registry.bucket), "get_blob", get_blob)
    assert registry.move_alias(3, entry) is False  # re-read after the 412: 5 is newer, left as is
    assert read(registry.alias_uri)["version"] == 5


def _together(n: int, work: Callable[[int], object]) -> list[object]:
    """Run ``work(i)`` for i < n on n threads released at once; their results in order."""
    barrier, results = threading.Barrier(n), [None] * n

    def one(i: int) -> None:
        barrier.wait()
        results[i] = work(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_publishers_racing_for_version_numbers_each_get_their_own(gcs_bucket: str) -> None:
    """Four publishers list the versions at once and all try 0001: GCS's create-only precondition
    lets exactly one have each number; nobody's version is overwritten."""
    results = _together(4, lambda i: publish.Registry(f"{gcs_bucket}/_registry", "race4").register({"run_id": f"r{i}"}))
    numbers = sorted(number for number, _ in results)  # type: ignore[misc]
    assert numbers == [1, 2, 3, 4]
    registry = publish.Registry(f"{gcs_bucket}/_registry", "race4")
    for number, data in results:  # type: ignore[misc]
        assert read(registry.version_uri(number))["run_id"] == data["run_id"]


def test_alias_writers_racing_leave_the_newest_version(gcs_bucket: str) -> None:
    entry = {"model_manifest": "gs://b/m/_MANIFEST.json", "model_fingerprint": "f", "run_id": "r"}
    registry = publish.Registry(f"{gcs_bucket}/_registry", "alias4")
    moved = _together(4, lambda i: registry.move_alias(i + 1, entry))
    assert read(registry.alias_uri)["version"] == 4 and moved[3] is True


def test_the_alias_never_moves_back(gcs_bucket: str) -> None:
    registry = publish.Registry(f"{gcs_bucket}/_registry", "alias")
    entry = {"model_manifest": "gs://b/m/_MANIFEST.json", "model_fingerprint": "f", "run_id": "r"}
    assert registry.move_alias(3, entry) is True
    assert registry.move_alias(2, entry) is False
    assert read(registry.alias_uri)["version"] == 3


def test_config_needs_a_model(tmp_path: Path, make_ctx: Callable) -> None:
    from loraflow.errors import LoraflowError

    ctx = make_ctx(
        "publish",
        {"decision": decision_dir(tmp_path, True)},
        {"registry_uri": "gs://b/r", "pipeline": "p", "run_id": "r"},
    )
    with pytest.raises(LoraflowError, match="model_manifest is required"):
        publish.run(ctx)


def test_vertex_model_registry_mirrors_versions_and_the_champion_alias(
    gcs_bucket: str, tmp_path: Path, make_ctx: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.vertex_standin import VertexStandIn

    vertex_cfg = {
        "project": "acme-p1",
        "region": "us-east5",
        "serving_container_image": "us-docker.pkg.dev/p1/s/vllm:1",
    }

    def run(model: artifacts.Manifest, run_id: str) -> tuple[dict, dict]:
        config = {"registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny", "run_id": run_id,
                  "vertex_model_registry": vertex_cfg}  # fmt: skip
        ctx = make_ctx("publish", {"decision": decision_dir(tmp_path, True, f"d-{run_id}")}, config, {"model": model})
        summary = publish.run(ctx)
        return summary, json.loads((ctx.out / "registry_entry.json").read_text())

    with VertexStandIn({}, tmp_path / "vertex") as standin:
        monkeypatch.setenv("LORAFLOW_VERTEX_ENDPOINT", standin.url)
        first = committed_model(gcs_bucket, tmp_path, "run-1", b"one")
        second = committed_model(gcs_bucket, tmp_path, "run-2", b"two")
        summary, entry = run(first, "run-1")
        name = "projects/acme-p1/locations/us-east5/models/loraflow-tiny"
        assert summary["vertex_model"] == f"{name}@1"
        assert entry["vertex_model_registry"]["artifact_uri"] == first.prefix  # the merged checkpoint's prefix
        assert entry["vertex_model_registry"]["labels"]["loraflow-run"] == "run-1"
        summary, entry = run(second, "run-2")
        assert summary["version"] == 2 and summary["vertex_model"] == f"{name}@2"
        aliases = {v["versionId"]: v["versionAliases"] for v in standin.models.versions(name)}
        assert aliases == {"1": [], "2": ["champion", "default"]}  # moved with the GCS alias, v1 kept
        assert read(f"{gcs_bucket}/_registry/tiny/aliases/champion.json")["version"] == 2
        run(second, "run-2")  # a retried publish: nothing uploaded twice
        assert len(standin.models.uploads) == 2


def test_vertex_model_registry_without_a_project_registers_nothing(
    gcs_bucket: str, tmp_path: Path, make_ctx: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraflow.errors import LoraflowError

    monkeypatch.delenv("LORAFLOW_VERTEX_PROJECT", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    model = committed_model(gcs_bucket, tmp_path)
    config = {"registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny", "run_id": "run-1",
              "vertex_model_registry": {"serving_container_image": "i"}}  # fmt: skip
    ctx = make_ctx("publish", {"decision": decision_dir(tmp_path, True)}, config, {"model": model})
    with pytest.raises(LoraflowError, match="needs a project"):
        publish.run(ctx)
    assert publish.Registry(f"{gcs_bucket}/_registry", "tiny").versions() == {}


def test_the_metric_a_version_recorded_is_read_from_each_entry_format() -> None:
    from loraflow.registry.store import recorded_metric

    assert recorded_metric({"metrics": {"accuracy": 0.75}}, "accuracy") == 0.75
    assert recorded_metric({"metrics": {"accuracy": 1}}, "accuracy") == 1.0
    # versions registered before `metrics` was recorded: the decision's tuned figure of that metric
    old = {"decision": {"metric": "accuracy", "tuned": 0.5, "tuned_metrics": {"f1": 0.25}}}
    assert recorded_metric(old, "accuracy") == 0.5
    assert recorded_metric(old, "f1") == 0.25
    assert recorded_metric({"metrics": {"accuracy": None}, **old}, "accuracy") == 0.5
    assert recorded_metric({"metrics": {"f1": 0.9}, **old}, "accuracy") == 0.5
    assert recorded_metric(old, "exact_match") is None
    assert recorded_metric({"decision": {"metric": "accuracy", "tuned": None}}, "accuracy") is None
    assert recorded_metric({}, "accuracy") is None
    assert recorded_metric({"metrics": {"accuracy": float("nan")}}, "accuracy") is None


def test_what_a_version_records_is_noted_whatever_it_is() -> None:
    from loraflow.registry.store import recorded_value

    old = {"decision": {"metric": "accuracy", "tuned": 0.5}}
    assert recorded_value({"metrics": {"accuracy": "abc"}, **old}, "accuracy") == "abc"
    assert recorded_value({"metrics": {"accuracy": None}, **old}, "accuracy") is None
    assert recorded_value({"metrics": {"f1": 0.9}, **old}, "accuracy") == 0.5
    assert recorded_value(old, "f1") is None


def test_the_metrics_a_version_records_are_the_tuned_models_scalars_and_the_gates_figure() -> None:
    decision = {"metric": "accuracy", "tuned": 0.75, "tuned_metrics": {"f1": 0.5, "n": 10, "label": "x",
                "flag": True, "per_class": [1, 2], "accuracy": 0.7}}  # fmt: skip
    assert publish.eval_metrics(decision) == {"f1": 0.5, "n": 10, "label": "x", "accuracy": 0.75}
    assert publish.eval_metrics({"metric": "accuracy", "tuned": None, "tuned_metrics": {"f1": 0.5}}) == {"f1": 0.5}
    assert publish.eval_metrics({"tuned": 0.75}) == {}
    assert publish.eval_metrics({}) == {}


def test_the_run_id_comes_from_the_output_prefix_when_the_config_has_none() -> None:
    raw = {"registry_uri": "gs://b/_registry", "pipeline": "Tiny.v2"}
    for out in ("gs://b/root/Tiny.v2/run-7/publish", "gs://b/root/Tiny.v2/run-7/publish/"):
        assert publish.resolve_config(dict(raw), True, out).run_id == "run-7"
    assert publish.resolve_config({**raw, "run_id": "given"}, True, "gs://b/root/p/run-7/publish").run_id == "given"
    with pytest.raises(LoraflowError, match="model_manifest is required"):
        publish.resolve_config({**raw, "run_id": "r"}, False)
    with pytest.raises(LoraflowError, match="pipeline 'a/b' must be letters"):
        publish.resolve_config({**raw, "run_id": "r", "pipeline": "a/b"}, True)


def test_a_publish_records_what_a_later_gate_and_a_reader_need(
    gcs_bucket: str, tmp_path: Path, make_ctx: Callable
) -> None:
    model = committed_model(gcs_bucket, tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    decision = {"promote": True, "metric": "accuracy", "tuned": 0.9, "eval_set_fingerprint": "e1", "reason": "better"}
    (d / "decision.json").write_text(json.dumps(decision))
    config = {"registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny"}
    ctx = make_ctx("publish", {"decision": d}, config, {"model": model})
    ctx = dataclasses.replace(ctx, output_uri=f"{gcs_bucket}/artifacts/tiny/run-9/publish")
    publish.run(ctx)
    version = read(f"{gcs_bucket}/_registry/tiny/versions/0001.json")
    assert version["metrics"] == {"accuracy": 0.9} and version["eval_set_fingerprint"] == "e1"
    assert version["run_id"] == "run-9" and version["version"] == 1
    alias = read(f"{gcs_bucket}/_registry/tiny/aliases/champion.json")
    assert alias["run_id"] == "run-9" and alias["alias"] == "champion"
    assert alias["version_uri"] == f"{gcs_bucket}/_registry/tiny/versions/0001.json"
    entry = json.loads((ctx.out / "registry_entry.json").read_text())
    assert entry["alias"] == "champion" and entry["alias_uri"] == f"{gcs_bucket}/_registry/tiny/aliases/champion.json"
    assert entry["run_id"] == "run-9" and entry["reason"] == "better" and entry["version"] == 1


def test_a_retried_older_publish_leaves_the_newer_champion_and_says_so(
    gcs_bucket: str, tmp_path: Path, publish_run: Callable
) -> None:
    first = committed_model(gcs_bucket, tmp_path, "run-1", b"one")
    second = committed_model(gcs_bucket, tmp_path, "run-2", b"two")
    publish_run(first, True, "run-1")
    publish_run(second, True, "run-2")
    summary, ctx = publish_run(first, True, "run-1")  # run-1's publish retried after run-2 promoted
    assert summary["version"] == 1
    assert read(f"{gcs_bucket}/_registry/tiny/aliases/champion.json")["version"] == 2
    assert json.loads((ctx.out / "registry_entry.json").read_text())["alias"] is None
    # the same run publishing another model is a new version, not the retry of the first
    third = committed_model(gcs_bucket, tmp_path, "run-1b", b"three")
    assert publish_run(third, True, "run-1")[0]["version"] == 3


def test_a_model_given_as_input_and_by_config_must_agree(gcs_bucket: str, tmp_path: Path, make_ctx: Callable) -> None:
    model = committed_model(gcs_bucket, tmp_path, "run-1", b"one")
    other = committed_model(gcs_bucket, tmp_path, "run-2", b"two")
    config = {"registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny", "run_id": "r",
              "model_manifest": other.uri}  # fmt: skip
    ctx = make_ctx("publish", {"decision": decision_dir(tmp_path, True)}, config, {"model": model})
    with pytest.raises(LoraflowError, match=r"the model input is .* but config model_manifest is"):
        publish.run(ctx)
    config["model_manifest"] = model.prefix  # the same model, named by its prefix
    ctx = make_ctx("publish", {"decision": decision_dir(tmp_path, True)}, config, {"model": model})
    assert publish.run(ctx)["model_manifest"] == model.uri


def test_a_model_not_promoted_is_named_in_the_record_when_given_as_input(
    gcs_bucket: str, tmp_path: Path, publish_run: Callable
) -> None:
    model = committed_model(gcs_bucket, tmp_path)
    summary, ctx = publish_run(model, False, "run-1", as_ref=True)
    assert summary["model_manifest"] == model.uri
    entry = json.loads((ctx.out / "registry_entry.json").read_text())
    assert entry["model_manifest"] == model.uri and entry["run_id"] == "run-1"
    assert entry["registry"] == f"{gcs_bucket}/_registry/tiny"


# ------------------------------------------------------------------ the champion as the gate reads it


def judged(root: str, tmp_path: Path, run: str = "run-1") -> tuple[artifacts.Manifest, ...]:
    """A run's committed model, its evaluate_tuned evaluation and the gate commit that judged it."""
    model = champions.committed_model(root, "tiny", run, tmp_path)
    evaluation = champions.committed_evaluation(root, "tiny", run, model, "1" * 90 + "0" * 10, tmp_path)
    local = tmp_path / f"gate-{run}"
    local.mkdir()
    (local / "decision.json").write_text(json.dumps({"promote": True, "metric": "accuracy", "tuned": 0.9}))
    gate = champions.commit_dir(
        local, f"{root}/tiny/{run}/gate", "gate", {"tuned_eval": champions.upstream(evaluation)}, {"promote": True}
    )
    return model, evaluation, gate


def test_the_gate_reads_the_champion_where_publish_writes_it(
    gcs_bucket: str, tmp_path: Path, make_ctx: Callable
) -> None:
    from loraflow.registry import store as registry

    reg, root = f"{gcs_bucket}/_registry", f"{gcs_bucket}/artifacts"
    assert registry.alias_uri(reg, "tiny") == f"{reg}/tiny/aliases/champion.json"
    assert registry.alias_uri(reg, "tiny") == publish.Registry(reg, "tiny").alias_uri
    assert registry.version_uri(reg, "tiny", 7) == f"{reg}/tiny/versions/0007.json"
    model, evaluation, gate = judged(root, tmp_path)
    assert registry.champion(reg, "tiny", root) is None
    config = {"registry_uri": reg, "pipeline": "tiny", "run_id": "run-1"}
    publish.run(make_ctx("publish", {"decision": tmp_path / "gate-run-1"}, config, {"model": model, "decision": gate}))
    version = read(f"{reg}/tiny/versions/0001.json")
    assert version["gate_manifest"] == gate.uri  # the gate that promoted it: the next gates find its evaluation
    champion = registry.champion(reg, "tiny", root)
    assert champion is not None and champion["version"] == 1 and champion["model_manifest"] == model.uri
    assert champion["version_uri"] == f"{reg}/tiny/versions/0001.json"
    assert champion["evaluation_manifest"] == evaluation.uri and champion["gate_manifest"] == gate.uri


def test_a_minimal_alias_and_version_are_read_and_malformed_ones_refused(gcs_bucket: str, tmp_path: Path) -> None:
    from loraflow.errors import ArtifactError
    from loraflow.registry import store as registry

    reg, root = f"{gcs_bucket}/_registry", f"{gcs_bucket}/artifacts"
    model, evaluation, gate = judged(root, tmp_path)
    # an alias with only its version, a version entry with its model and run only: both as publish reads them
    artifacts.write_json(registry.alias_uri(reg, "tiny"), {"version": 1})
    artifacts.write_json(registry.version_uri(reg, "tiny", 1), {"model_manifest": model.uri, "run_id": "run-1"})
    champion = registry.champion(reg, "tiny", root)
    assert champion == {
        "model_manifest": model.uri,
        "run_id": "run-1",
        "version": 1,
        "version_uri": registry.version_uri(reg, "tiny", 1),
        "alias_uri": registry.alias_uri(reg, "tiny"),
        "gate_manifest": gate.uri,
        "model_fingerprint": model.fingerprint,
        "evaluation_manifest": evaluation.uri,
        "eval_set_fingerprint": "eval-fp",
    }
    artifacts.write_json(registry.version_uri(reg, "tiny", 1), {"version": 2, "model_manifest": model.uri})
    with pytest.raises(ArtifactError, match="does not hold version 1"):
        registry.champion(reg, "tiny", root)
    artifacts.write_json(registry.version_uri(reg, "tiny", 1), ["not", "an", "entry"])
    with pytest.raises(ArtifactError, match="not a JSON object"):
        registry.champion(reg, "tiny", root)
    artifacts.write_json(registry.alias_uri(reg, "tiny"), [1])
    with pytest.raises(ArtifactError, match="not a JSON object"):
        registry.champion(reg, "tiny", root)


def test_garbage_in_the_registry_never_crashes_publish_and_is_named(
    gcs_bucket: str, tmp_path: Path, publish_run: Callable
) -> None:
    """A version file that is not JSON (or is huge) is no version this run registered: publish takes the next
    number. An alias it cannot read is refused naming it and the repair (the version stays registered: the
    retried publish finds it and moves the repaired alias)."""
    reg = f"{gcs_bucket}/_registry"
    bucket, base = gcs.split_uri(reg)
    objects = gcs.client().bucket(bucket)
    objects.blob(f"{base}/tiny/versions/0001.json").upload_from_string(b"not json")
    objects.blob(f"{base}/tiny/versions/0002.json").upload_from_string(b'{"pad": "' + b"x" * (17 << 20) + b'"}')
    objects.blob(f"{base}/tiny/versions/0003.json").upload_from_string(b"[]")
    model = committed_model(gcs_bucket, tmp_path)
    summary, _ = publish_run(model, True, "run-1")
    assert summary["version"] == 4
    assert read(f"{reg}/tiny/aliases/champion.json")["version"] == 4
    objects.blob(f"{base}/tiny/aliases/champion.json").upload_from_string(b"{oops")
    other = committed_model(gcs_bucket, tmp_path, "run-2", b"two")
    with pytest.raises(ArtifactError, match="not JSON") as err:
        publish_run(other, True, "run-2")
    assert f"{reg}/tiny/aliases/champion.json" in str(err.value) and "repair it" in str(err.value)


def test_a_decision_without_a_reason_is_recorded_with_the_default_one(
    gcs_bucket: str, tmp_path: Path, make_ctx: Callable
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "decision.json").write_text(json.dumps({"promote": False}))
    config = {
        "registry_uri": f"{gcs_bucket}/_registry",
        "pipeline": "tiny",
        "run_id": "r",
        "model_manifest": "gs://b/m",
    }
    ctx = make_ctx("publish", {"decision": d}, config)
    publish.run(ctx)
    entry = json.loads((ctx.out / "registry_entry.json").read_text())
    assert (
        entry["reason"] == "the gate did not promote this model"
        and entry["model_manifest"] == "gs://b/m/_MANIFEST.json"
    )


def test_the_run_id_read_from_the_output_prefix_keeps_a_trailing_capital_x(gcs_bucket: str) -> None:
    config = {"registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny"}
    for out in (f"{gcs_bucket}/runs/tiny/runX/publish", f"{gcs_bucket}/runs/tiny/runX/publish/"):
        assert publish.resolve_config(config, True, out).run_id == "runX", out
