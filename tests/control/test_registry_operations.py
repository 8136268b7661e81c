"""Registry operations (loraflow/registry/operations.py) against the GCS emulator, which enforces
generation preconditions as GCS does: list, promote, roll back, the audit trail, concurrent moves."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError
from loraflow.registry import alias, audit, operations, store
from loraflow.registry import vertex as vr
from loraflow.steps import publish
from loraflow.storage import artifacts, gcs
from loraflow.storage.verify import verify_artifact
from tests.vertex_standin import VertexStandIn

from .champions import register_champion

PIPELINE = "tiny"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def reg(gcs_bucket: str, tmp_path: Path) -> operations.PipelineRegistry:
    return three_versions(gcs_bucket, tmp_path)


def three_versions(gcs_bucket: str, tmp_path: Path) -> operations.PipelineRegistry:
    """Three promoted versions (accuracy 0.6, 0.7, 0.8), version 3 the champion, as publish leaves them."""
    root, registry_uri = f"{gcs_bucket}/artifacts", f"{gcs_bucket}/_registry"
    for n, accuracy in ((1, 0.6), (2, 0.7), (3, 0.8)):
        register_champion(registry_uri, root, tmp_path, accuracy=accuracy, pipeline=PIPELINE, run=f"run-{n}", version=n)
    return operations.PipelineRegistry(registry_uri, PIPELINE, root)


def objects(gcs_bucket: str) -> dict[str, int]:
    bucket, base = gcs.split_uri(gcs_bucket)
    return {b.name: b.generation for b in gcs.client().list_blobs(bucket, prefix=base + "/")}


def champion_version(reg: operations.PipelineRegistry) -> int:
    found = store.champion(reg.registry_uri, reg.pipeline, reg.artifact_root)
    assert found is not None
    return int(found["version"])


def test_the_listing_shows_every_version_with_its_metrics_lineage_and_the_champion(
    reg: operations.PipelineRegistry,
) -> None:
    listed = operations.listing(reg)
    assert listed["champion"] == 3 and [v["version"] for v in listed["versions"]] == [1, 2, 3]
    v2 = listed["versions"][1]
    assert v2["metrics"] == {"accuracy": 0.7, "n": 100} and v2["run_id"] == "run-2"
    assert v2["model_manifest"].endswith("/tiny/run-2/merge_adapter/_MANIFEST.json")
    assert v2["gate_manifest"].endswith("/tiny/run-2/gate/_MANIFEST.json")
    assert [v["champion"] for v in listed["versions"]] == [False, False, True]
    assert "alias_problem" not in listed and all("problem" not in v for v in listed["versions"])
    text = operations.render(listed)
    assert "champion: version 3" in text and "accuracy=0.7" in text and "audit trail: (empty)" in text


def test_a_rollback_moves_the_champion_back_records_why_and_deletes_nothing(
    reg: operations.PipelineRegistry, gcs_bucket: str
) -> None:
    before = objects(gcs_bucket)
    done = operations.rollback(reg, actor="alice", reason="v3 regressed on the new eval set", via="cli")
    assert done["champion"] == 2 and champion_version(reg) == 2  # the gate reads (and verifies) the new champion
    event = done["event"]
    assert (event["action"], event["from_version"], event["to_version"]) == ("rollback", 3, 2)
    assert (event["actor"], event["reason"], event["via"]) == ("alice", "v3 regressed on the new eval set", "cli")
    after = objects(gcs_bucket)
    changed = {name for name in before if after.get(name) != before[name]}
    assert changed == {f"{gcs.split_uri(reg.registry_uri)[1]}/tiny/aliases/champion.json"}  # nothing else touched
    listed = operations.listing(reg)
    assert [(v["version"], v["champion"], v["withdrawn"]) for v in listed["versions"]] == [
        (1, False, False),
        (2, True, False),
        (3, False, True),
    ]
    assert listed["audit"] == [event]
    assert "rollback v3 -> v2  by alice (cli)" in operations.render(listed)


def test_rollbacks_walk_back_skipping_withdrawn_versions_until_none_is_left(reg: operations.PipelineRegistry) -> None:
    operations.rollback(reg, actor="a", reason="r1", via="cli")  # 3 -> 2
    operations.rollback(reg, actor="a", reason="r2", via="cli")  # 2 -> 1
    with pytest.raises(operations.NothingToRollBack, match=r"version 1, has no older version"):
        operations.rollback(reg, actor="a", reason="r3", via="cli")
    operations.promote(reg, 3, actor="b", reason="the eval set was wrong, v3 is fine", via="cli")
    assert champion_version(reg) == 3
    # 2 is still withdrawn (rolled back, never put back): the next rollback goes to 1
    done = operations.rollback(reg, actor="a", reason="r4", via="cli")
    assert done["champion"] == 1
    trail = audit.read_trail(reg.registry_uri, reg.pipeline)
    assert [(e["sequence"], e["action"], e["from_version"], e["to_version"]) for e in trail] == [
        (1, "rollback", 3, 2),
        (2, "rollback", 2, 1),
        (3, "promote", 1, 3),
        (4, "rollback", 3, 1),
    ]


def test_nothing_to_roll_back_without_a_champion(gcs_bucket: str) -> None:
    empty = operations.PipelineRegistry(f"{gcs_bucket}/_registry", "none", f"{gcs_bucket}/artifacts")
    with pytest.raises(operations.NothingToRollBack, match=r"has no champion yet"):
        operations.rollback(empty, actor="a", reason="r", via="cli")
    text = operations.render(operations.listing(empty))
    assert "; champion: none yet" in text and "(no versions: no run" in text and "audit trail: (empty)" in text


def test_an_unknown_version_is_named_with_the_versions_there_are(reg: operations.PipelineRegistry) -> None:
    with pytest.raises(operations.UnknownVersion, match=r"no registry version 9 \(versions: 1, 2, 3\)"):
        operations.promote(reg, 9, actor="a", reason="r", via="cli")
    assert champion_version(reg) == 3


def test_a_move_needs_a_reason(reg: operations.PipelineRegistry) -> None:
    with pytest.raises(operations.RegistryOperationError, match=r"a rollback needs a reason for the audit trail"):
        operations.rollback(reg, actor="a", reason="  ", via="cli")
    with pytest.raises(operations.RegistryOperationError, match=r"a promote needs a reason"):
        operations.promote(reg, 2, actor="a", reason="", via="cli")
    with pytest.raises(operations.RegistryOperationError, match=r"the reason has 1001 characters; .* at most 1000"):
        operations.rollback(reg, actor="a", reason="x" * 1001, via="cli")
    assert audit.read_trail(reg.registry_uri, reg.pipeline) == []


def tamper(manifest_uri: str, name: str, data: bytes) -> None:
    bucket, path = gcs.split_uri(manifest_uri.rsplit("/", 1)[0] + "/" + name)
    gcs.client().bucket(bucket).blob(path).upload_from_string(data)


def test_a_version_whose_model_no_longer_matches_its_manifest_is_refused(reg: operations.PipelineRegistry) -> None:
    listed = {v["version"]: v for v in operations.listing(reg)["versions"]}
    tamper(listed[2]["model_manifest"], "model.safetensors", b"other weights, same name")
    with pytest.raises(operations.VersionDoesNotVerify, match=r"version 2 .* model.safetensors: .* the manifest says"):
        operations.promote(reg, 2, actor="a", reason="r", via="cli")
    with pytest.raises(operations.VersionDoesNotVerify, match=r"refusing to roll back to it"):
        operations.rollback(reg, actor="a", reason="r", via="cli")
    assert champion_version(reg) == 3 and audit.read_trail(reg.registry_uri, reg.pipeline) == []


def test_a_version_whose_lineage_does_not_verify_is_refused(reg: operations.PipelineRegistry, gcs_bucket: str) -> None:
    listed = {v["version"]: v for v in operations.listing(reg)["versions"]}
    bucket, path = gcs.split_uri(listed[1]["gate_manifest"])
    gcs.client().bucket(bucket).blob(path).delete()  # its run's gate commit is gone
    with pytest.raises(operations.VersionDoesNotVerify, match=r"version 1 .*run's gate"):
        operations.promote(reg, 1, actor="a", reason="r", via="cli")
    assert champion_version(reg) == 3


def test_two_moves_decided_from_the_same_alias_cannot_both_win(reg: operations.PipelineRegistry) -> None:
    """The emulator enforces the generation precondition: the second write from a stale read gets 412."""
    from google.api_core.exceptions import PreconditionFailed

    state = alias.read(reg.registry_uri, reg.pipeline)
    entry = store.verified(
        artifacts.read_json(store.version_uri(reg.registry_uri, PIPELINE, 1)),
        1,
        store.version_uri(reg.registry_uri, PIPELINE, 1),
        PIPELINE,
        reg.artifact_root,
        AssertionError,
    )
    alias.move(reg.registry_uri, PIPELINE, state, 1, entry, action="promote", actor="a", reason="r", via="cli")
    with pytest.raises(PreconditionFailed):
        alias.move(reg.registry_uri, PIPELINE, state, 2, entry, action="promote", actor="b", reason="r", via="cli")
    assert alias.read(reg.registry_uri, PIPELINE).version == 1
    assert [e["actor"] for e in audit.read_trail(reg.registry_uri, PIPELINE)] == ["a"]


def test_an_operator_whose_alias_moved_meanwhile_is_refused_naming_who_moved_it(
    reg: operations.PipelineRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = operations._verified

    def verified_while_bob_rolls_back(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(operations, "_verified", real)
        operations.rollback(reg, actor="bob", reason="bob's reason", via="cli")  # 3 -> 2, while alice decides
        return real(*args, **kwargs)

    monkeypatch.setattr(operations, "_verified", verified_while_bob_rolls_back)
    with pytest.raises(operations.ConcurrentMove, match=r"held version 3, now 2, moved by bob .*nothing was changed"):
        operations.promote(reg, 1, actor="alice", reason="alice's reason", via="cli")
    assert champion_version(reg) == 2
    assert [e["actor"] for e in audit.read_trail(reg.registry_uri, PIPELINE)] == ["bob"]


def test_racing_operators_each_win_or_are_refused_and_the_trail_says_exactly_what_happened(
    reg: operations.PipelineRegistry,
) -> None:
    n = 4
    barrier, results = threading.Barrier(n), [None] * n

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = operations.promote(reg, 1 + i % 2, actor=f"op{i}", reason="race", via="cli")  # type: ignore[call-overload]
        except operations.ConcurrentMove as exc:
            results[i] = exc  # type: ignore[call-overload]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    moved = [r for r in results if isinstance(r, dict) and r["event"] is not None]
    assert moved and all(isinstance(r, (dict, operations.ConcurrentMove)) for r in results)
    trail = audit.read_trail(reg.registry_uri, PIPELINE)
    assert sorted(e["actor"] for e in trail) == sorted(r["event"]["actor"] for r in moved)
    assert [e["sequence"] for e in trail] == list(range(1, len(trail) + 1))
    assert all(e["from_version"] == prev["to_version"] for prev, e in itertools.pairwise(trail))
    assert alias.read(reg.registry_uri, PIPELINE).version == trail[-1]["to_version"]


def test_a_move_whose_event_was_not_written_is_listed_and_recorded_by_the_next_move(
    reg: operations.PipelineRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "record", lambda *a, **k: False)  # the mover died right after its alias write
    operations.rollback(reg, actor="gone", reason="r1", via="cli")
    monkeypatch.undo()
    listed = operations.listing(reg)
    [pending] = listed["audit"]
    assert pending["pending"] is True and pending["actor"] == "gone"
    assert operations.render(listed).endswith('by gone (cli): "r1"  [event not yet written; from the alias]')
    assert audit.read_trail(reg.registry_uri, PIPELINE) == []  # not stored: the listing shows it from the alias
    operations.promote(reg, 3, actor="next", reason="r2", via="cli")
    trail = audit.read_trail(reg.registry_uri, PIPELINE)
    assert [(e["actor"], "pending" in e) for e in trail] == [("gone", False), ("next", False)]
    assert "[event not yet written" not in operations.render(operations.listing(reg))


def test_publish_moves_are_in_the_trail_and_a_retried_publish_never_undoes_a_rollback(
    reg: operations.PipelineRegistry,
) -> None:
    operations.rollback(reg, actor="alice", reason="bad", via="cli")  # 3 -> 2
    entry = artifacts.read_json(store.version_uri(reg.registry_uri, PIPELINE, 3))
    models = publish.Registry(reg.registry_uri, PIPELINE)
    assert models.move_alias(3, entry, "better") is False  # run-3's publish retried after the rollback
    assert champion_version(reg) == 2
    entry4 = {**entry, "run_id": "run-4"}
    assert models.move_alias(4, entry4, "the gate's reason") is True  # a new promotion moves forward
    last = audit.read_trail(reg.registry_uri, PIPELINE)[-1]
    assert (last["action"], last["from_version"], last["to_version"]) == ("publish", 2, 4)
    assert (last["actor"], last["reason"], last["via"]) == ("gate of run run-4", "the gate's reason", "publish")


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[VertexStandIn]:
    with VertexStandIn({}, tmp_path, state_delay=0.05) as s:
        yield s


def test_moves_are_mirrored_to_the_vertex_model_registry(
    reg: operations.PipelineRegistry, standin: VertexStandIn
) -> None:
    target = vr.Target.from_config({"project": "p1", "serving_container_image": "img"}, PIPELINE, {})
    vertex = vr.VertexModelRegistry(target, PIPELINE, standin.url)
    for n in (1, 2, 3):
        vertex.publish(
            version=n, champion=True, artifact_uri=f"gs://b/{n}", run_id=f"run-{n}", fingerprint=f"{n}" * 20,
            manifest_uri=f"gs://b/{n}/_MANIFEST.json",
        )  # fmt: skip
    mirrored = operations.PipelineRegistry(reg.registry_uri, PIPELINE, reg.artifact_root, vertex)
    done = operations.rollback(mirrored, actor="alice", reason="bad", via="cli")
    assert done["vertex_model"] == f"{vertex.model_name}@2" and done["vertex_aliases"] == ["champion", "default"]
    aliases = {v["versionId"]: v["versionAliases"] for v in standin.models.versions(vertex.model_name)}
    assert aliases == {"1": [], "2": ["champion", "default"], "3": []}  # nothing deleted in Vertex either


def test_a_version_missing_from_vertex_fails_the_mirror_and_says_how_to_repair_it(
    reg: operations.PipelineRegistry, standin: VertexStandIn
) -> None:
    target = vr.Target.from_config({"project": "p1", "serving_container_image": "img"}, PIPELINE, {})
    vertex = vr.VertexModelRegistry(target, PIPELINE, standin.url)
    vertex.publish(
        version=3, champion=True, artifact_uri="gs://b/3", run_id="run-3", fingerprint="3" * 20,
        manifest_uri="gs://b/3/_MANIFEST.json",
    )  # fmt: skip
    mirrored = operations.PipelineRegistry(reg.registry_uri, PIPELINE, reg.artifact_root, vertex)
    with pytest.raises(Exception, match=r"champion of tiny is version 2, but mirroring it .* no version labelled"):
        operations.rollback(mirrored, actor="alice", reason="bad", via="cli")
    assert champion_version(reg) == 2  # GCS is the source of truth: its move stands


# ------------------------------------------------------------------- the trail's continuity and refusals


def test_after_the_alias_is_deleted_the_next_move_continues_the_trail(reg: operations.PipelineRegistry) -> None:
    operations.rollback(reg, actor="a", reason="r1", via="cli")  # #1: 3 -> 2
    operations.rollback(reg, actor="a", reason="r2", via="cli")  # #2: 2 -> 1
    bucket, name = gcs.split_uri(store.alias_uri(reg.registry_uri, PIPELINE))
    gcs.client().bucket(bucket).blob(name).delete()  # what a refused alias's message recommends
    done = operations.promote(reg, 3, actor="ops", reason="alias repaired", via="cli")
    assert (done["action"], done["event"]["sequence"], done["event"]["from_version"]) == ("promote", 3, None)
    assert operations.summary_line(done).endswith('promote  (none) -> v3  by ops (cli): "alias repaired"')
    trail = audit.read_trail(reg.registry_uri, PIPELINE)
    assert [(e["sequence"], e["actor"], e["to_version"]) for e in trail] == [(1, "a", 2), (2, "a", 1), (3, "ops", 3)]
    assert champion_version(reg) == 3


def test_recording_a_sequence_twice_keeps_the_first_event(reg: operations.PipelineRegistry) -> None:
    def move(actor: str) -> dict[str, object]:
        return audit.event(
            sequence=1, action="promote", from_version=3, to_version=2, actor=actor, reason="r", via="cli"
        )

    assert audit.record(reg.registry_uri, PIPELINE, move("first")) is True
    assert audit.record(reg.registry_uri, PIPELINE, move("second")) is False
    assert [e["actor"] for e in audit.read_trail(reg.registry_uri, PIPELINE)] == ["first"]


def test_an_event_filed_under_another_number_is_listed_as_a_problem(reg: operations.PipelineRegistry) -> None:
    done = operations.rollback(reg, actor="a", reason="r", via="cli")  # #1
    artifacts.write_json(audit.event_uri(reg.registry_uri, PIPELINE, 5), done["event"])  # a copy under #5
    first, copy = audit.read_trail(reg.registry_uri, PIPELINE)
    assert first == done["event"]
    assert copy["sequence"] == 5 and copy["uri"] == audit.event_uri(reg.registry_uri, PIPELINE, 5)
    assert "holds the event of sequence 1, filed under 5" in copy["problem"]


def test_a_rolled_back_version_promoted_again_is_a_rollback_target_again(reg: operations.PipelineRegistry) -> None:
    operations.rollback(reg, actor="a", reason="r1", via="cli")  # 3 -> 2
    operations.rollback(reg, actor="a", reason="r2", via="cli")  # 2 -> 1: 2 and 3 withdrawn
    operations.promote(reg, 2, actor="b", reason="2 was fine", via="cli")  # 2 is put back
    operations.promote(reg, 3, actor="b", reason="3 too", via="cli")
    assert operations.rollback(reg, actor="a", reason="r3", via="cli")["champion"] == 2


class Mirror:
    """A stand-in for the Vertex AI Model Registry mirror: records each champion it is asked to hold."""

    model_name = "projects/p/locations/r/models/loraflow-tiny"

    def __init__(self) -> None:
        self.moved: list[int] = []

    def move_champion(self, version: int) -> dict[str, object]:
        self.moved.append(version)
        return {"model": self.model_name, "version_id": str(version), "version_aliases": ["champion", "default"]}


def mirrored(reg: operations.PipelineRegistry) -> tuple[operations.PipelineRegistry, Mirror]:
    mirror = Mirror()
    return operations.PipelineRegistry(reg.registry_uri, PIPELINE, reg.artifact_root, mirror), mirror  # type: ignore[arg-type]


def test_promoting_the_champion_mirrors_it_again_and_moves_nothing(
    reg: operations.PipelineRegistry, gcs_bucket: str
) -> None:
    with_mirror, mirror = mirrored(reg)
    before = objects(gcs_bucket)
    done = operations.promote(with_mirror, 3, actor="a", reason="repair the mirror", via="cli")
    assert done["event"] is None and done["note"] == "version 3 is the champion already"
    assert (done["action"], done["champion"], done["pipeline"]) == ("promote", 3, PIPELINE)
    assert mirror.moved == [3] and done["vertex_model"] == f"{Mirror.model_name}@3"
    assert operations.summary_line(done) == (
        f"tiny: version 3 is the champion already; Vertex AI {Mirror.model_name}@3 holds champion, default"
    )
    assert objects(gcs_bucket) == before


def test_promoting_a_tampered_champion_is_refused_and_never_mirrored(reg: operations.PipelineRegistry) -> None:
    with_mirror, mirror = mirrored(reg)
    champion = {v["version"]: v for v in operations.listing(reg)["versions"]}[3]
    tamper(champion["model_manifest"], "model.safetensors", b"other weights, same name")
    with pytest.raises(
        operations.VersionDoesNotVerify, match=r"version 3 .* model.safetensors.*refusing to promote it"
    ):
        operations.promote(with_mirror, 3, actor="a", reason="repair the mirror", via="cli")
    assert mirror.moved == []


def test_promoting_the_champion_rewrites_an_alias_that_names_another_model(reg: operations.PipelineRegistry) -> None:
    where = store.alias_uri(reg.registry_uri, PIPELINE)
    v1 = artifacts.read_json(store.version_uri(reg.registry_uri, PIPELINE, 1))
    forged = {**artifacts.read_json(where), "model_manifest": v1["model_manifest"]}  # version 3, v1's model
    artifacts.write_json(where, forged)
    with pytest.raises(ArtifactError, match=r"the alias names the model"):
        store.champion(reg.registry_uri, PIPELINE, reg.artifact_root)  # the gate refuses it
    with_mirror, mirror = mirrored(reg)
    done = operations.promote(with_mirror, 3, actor="ops", reason="repair the alias", via="cli")
    assert (done["event"]["from_version"], done["event"]["to_version"]) == (3, 3) and mirror.moved == [3]
    assert champion_version(reg) == 3  # the gate trusts it again


def test_a_model_manifest_rewritten_in_place_is_refused(reg: operations.PipelineRegistry, tmp_path: Path) -> None:
    """A bucket writer replaces version 2's weights, rewrites its model's manifest to match (same URI) and
    the version's fingerprint: the files verify, but the run's gate judged the model as it was."""
    uri = store.version_uri(reg.registry_uri, PIPELINE, 2)
    entry = artifacts.read_json(uri)
    manifest = artifacts.read_json(entry["model_manifest"])
    local = tmp_path / "other-model"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"other weights")
    files = artifacts.upload_tree(local, manifest["prefix"])  # over the old file, same name
    artifacts.write_json(entry["model_manifest"], {**manifest, "files": files})
    new = artifacts.read_manifest(entry["model_manifest"])
    assert new.fingerprint != entry["model_fingerprint"]
    assert verify_artifact(new.uri).ok  # its files match the rewritten manifest
    artifacts.write_json(uri, {**entry, "model_fingerprint": new.fingerprint})
    with pytest.raises(operations.VersionDoesNotVerify, match=r"version 2 .* judged an evaluation of the model"):
        operations.promote(reg, 2, actor="a", reason="r", via="cli")
    assert champion_version(reg) == 3


@pytest.fixture
def forbidden_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    """GCS answers 403 to every read of a champion alias (the credentials lost their role on it)."""
    from google.api_core.exceptions import Forbidden
    from google.cloud.storage import Blob, Bucket

    def guarded(real):  # type: ignore[no-untyped-def]
        def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            name = args[0] if isinstance(self, Bucket) else self.name
            if name.endswith("/aliases/champion.json"):
                raise Forbidden(f"GET {name}: caller does not have storage.objects.get access")
            return real(self, *args, **kwargs)

        return read

    monkeypatch.setattr(Bucket, "get_blob", guarded(Bucket.get_blob))
    monkeypatch.setattr(Blob, "download_as_bytes", guarded(Blob.download_as_bytes))


def test_a_403_reading_the_alias_raises_and_never_means_no_champion(
    reg: operations.PipelineRegistry, forbidden_alias: None
) -> None:
    from google.api_core.exceptions import Forbidden

    with pytest.raises(Forbidden):
        store.champion(reg.registry_uri, PIPELINE, reg.artifact_root)  # the gate: never "compare with the base"
    with pytest.raises(Forbidden):
        operations.listing(reg)
    with pytest.raises(Forbidden):
        operations.promote(reg, 1, actor="a", reason="r", via="cli")
    with pytest.raises(Forbidden):
        publish.Registry(reg.registry_uri, PIPELINE).move_alias(4, {"run_id": "run-4"}, "r")
    assert audit.read_trail(reg.registry_uri, PIPELINE) == []


def test_a_spec_names_its_registry_its_artifact_root_and_its_vertex_mirror(tmp_path: Path) -> None:
    from loraflow.spec.schema import load_spec

    text = (REPO / "pipelines" / "tiny-llama-lora.yaml").read_text()
    spec_file = tmp_path / "tiny-llama-lora.yaml"
    spec_file.write_text(
        text + "\npublish:\n  vertex_model_registry:\n    project: acme-ml9\n    serving_container_image: img\n"
    )
    spec = load_spec(spec_file)
    reg = operations.PipelineRegistry.for_spec(spec)
    assert (reg.registry_uri, reg.pipeline, reg.artifact_root) == (spec.registry_uri, spec.name, spec.artifact_root)
    assert reg.vertex is not None and reg.vertex.model_name.endswith("/models/loraflow-tiny-llama-lora")
    assert (reg.vertex.target.project, reg.vertex.target.image, reg.vertex.pipeline) == ("acme-ml9", "img", spec.name)
    assert operations.PipelineRegistry.for_spec(load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml")).vertex is None


def test_the_actor_is_loraflow_actor_else_the_local_user(monkeypatch: pytest.MonkeyPatch) -> None:
    import getpass

    monkeypatch.setattr(getpass, "getuser", lambda: "local-user")
    monkeypatch.setenv("LORAFLOW_ACTOR", "ci-bot")
    assert operations.default_actor() == "ci-bot"
    monkeypatch.delenv("LORAFLOW_ACTOR")
    assert operations.default_actor() == "local-user"
