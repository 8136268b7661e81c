"""The bucket writer's lane: names, cache entries and registry aliases written by anyone who can write a
bucket reach no further than their folder, their stage and the artifact root (docs/security.md).

Property tests over names (loraflow/storage/local_paths.py); then, per caller, a hostile listing on the GCS
emulator that is refused before anything is written; then cache entries and aliases that point
elsewhere; then a source that changes between the cache key and the step's fetch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraflow.errors import ArtifactError
from loraflow.pipeline import handoff, runner
from loraflow.registry import store as registry
from loraflow.steps._harness import StepContext, run_step
from loraflow.storage import artifacts, checkpoint_sync, gcs
from loraflow.storage.local_paths import UnsafeNameError, local_paths, safe_join

from .champions import committed_evaluation, committed_gate, committed_model, register_champion

PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def blob(uri: str):
    bucket, path = gcs.split_uri(uri)
    return gcs.client().bucket(bucket).blob(path)


def hostile_blob(prefix: str, name: str):
    """An object a bucket writer names as they like (``gcs.split_uri`` would refuse ``..`` in a URI)."""
    bucket, path = gcs.split_uri(prefix)
    return gcs.client().bucket(bucket).blob(f"{path}/{name}")


def all_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


# ------------------------------------------------------------------------------ names, by property


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/`` holding ``inner -> root/sub`` (stays inside) and ``escape -> outside`` (does not)."""
    base = tmp_path_factory.mktemp("names")
    (base / "outside").mkdir()
    root = base / "root"
    (root / "sub").mkdir(parents=True)
    (root / "inner").symlink_to(root / "sub")
    (root / "escape").symlink_to(base / "outside")
    return root


# Segments that matter: plain ones, dots, the two symlinks of ``tree``, separators and odd characters.
SEGMENT = st.one_of(
    st.sampled_from(["a", "b.txt", "..", ".", "", "inner", "escape", "...", "a..b", " ", "é", "~"]),
    st.text(alphabet=string.ascii_letters + string.digits + "._-\\\x00:", min_size=1, max_size=6),
)
NAME = st.lists(SEGMENT, min_size=1, max_size=5).map("/".join) | st.text(max_size=12)


@PROPERTY
@given(name=NAME)
def test_any_name_safe_join_accepts_lies_inside_the_folder(tree: Path, name: str) -> None:
    try:
        path = safe_join(tree, name, what="source gs://b/data/")
    except UnsafeNameError as exc:
        assert repr(name) in str(exc) and "source gs://b/data/" in str(exc)  # says which name, from where
        return
    resolved = path.resolve()
    assert resolved.is_relative_to(tree.resolve()) and resolved != tree.resolve()


PLAIN = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=8)
PLAIN_NAME = st.lists(PLAIN, min_size=1, max_size=4).map("/".join)


@PROPERTY
@given(
    name=st.one_of(
        PLAIN_NAME.map(lambda n: "/" + n),  # absolute
        st.tuples(PLAIN_NAME, st.sampled_from(["..", "."]), PLAIN_NAME).map("/".join),  # a dot segment
        st.tuples(PLAIN_NAME, st.sampled_from(["\\", "\x00", "//"]), PLAIN_NAME).map("".join),  # odd separator
        PLAIN_NAME.map(lambda n: n + "/"),  # a trailing slash: an empty segment
        PLAIN_NAME.map(lambda n: "escape/" + n),  # through a symlink that leaves the folder
        st.just(""),
    )
)
def test_any_hostile_name_is_refused_naming_it(tree: Path, name: str) -> None:
    with pytest.raises(UnsafeNameError) as err:
        safe_join(tree, name, what="manifest gs://b/p/_MANIFEST.json")
    assert repr(name) in str(err.value) and "manifest gs://b/p/_MANIFEST.json" in str(err.value)


@PROPERTY
@given(name=PLAIN_NAME)
def test_plain_names_are_accepted_where_they_point(tree: Path, name: str) -> None:
    assert safe_join(tree, name, what="x") == tree.joinpath(*name.split("/"))


def test_a_listing_is_refused_whole_and_says_how_many_names_were_refused(tmp_path: Path) -> None:
    backslashed = "a\\b"
    more = re.escape(f"and 2 more name(s) are refused: {'/etc/x'!r}, {backslashed!r}")
    with pytest.raises(UnsafeNameError, match=rf"'\.\./x'.*{more}"):
        local_paths(tmp_path, ["ok.txt", "../x", "/etc/x", "a\\b"], what="source gs://b/s/")
    with pytest.raises(UnsafeNameError, match="another listed name puts files inside it"):
        local_paths(tmp_path, ["a", "a/b"], what="source gs://b/s/")
    assert local_paths(tmp_path, ["a/b", "a/c"], what="x") == {"a/b": tmp_path / "a" / "b", "a/c": tmp_path / "a" / "c"}
    assert all_files(tmp_path) == []


# ------------------------------------------------------------------------------ each caller, on the emulator


HOSTILE = ["../../x", "/etc/x", "a\\b", "sub/../../x"]


@pytest.fixture
def cwd_and_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Work in ``tmp_path/work`` with the step scratch under it: a name that escaped would land in tmp_path."""
    work = tmp_path / "work"
    (work / "scratch").mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("LORAFLOW_SCRATCH", str(work / "scratch"))
    yield tmp_path


def hostile_manifest(prefix: str, name: str) -> str:
    """A manifest as a bucket writer could put it: a good file (sorted first) and a hostile one."""
    blob(f"{prefix}/!first.txt").upload_from_string(b"ok")
    data = {
        "format": artifacts.MANIFEST_FORMAT,
        "stage": "s",
        "prefix": prefix,
        "files": {"!first.txt": {"size": 2, "crc32c": "G2NCVA=="}, name: {"size": 2, "crc32c": "G2NCVA=="}},
        "cache_key": "K",
    }
    uri = artifacts.manifest_uri(prefix)
    artifacts.write_json(uri, data)
    return uri


@pytest.mark.parametrize("name", HOSTILE)
def test_fetch_refuses_a_hostile_manifest_and_writes_nothing(gcs_bucket: str, cwd_and_scratch: Path, name: str) -> None:
    uri = hostile_manifest(f"{gcs_bucket}/p/run-1/s", name)
    with pytest.raises(ArtifactError, match="may not become a local file") as err:
        artifacts.read_manifest(uri)
    assert repr(name) in str(err.value) and uri in str(err.value)
    # Even a manifest that was never read through read_manifest: fetch checks every name before the first byte.
    with pytest.raises(UnsafeNameError) as err:
        artifacts.fetch(
            artifacts.Manifest(uri, json.loads(blob(uri).download_as_bytes())), cwd_and_scratch / "work" / "dest"
        )
    assert repr(name) in str(err.value) and f"manifest {uri}" in str(err.value)
    assert all_files(cwd_and_scratch) == []


def _echo_step(ctx: StepContext) -> dict:
    return {"files": sorted(p.name for p in ctx.inputs["data"].rglob("*"))}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_step_given_a_hostile_manifest_exits_2_with_the_name_and_writes_nothing(
    gcs_bucket: str, cwd_and_scratch: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    uri = hostile_manifest(f"{gcs_bucket}/p/run-1/s", name)
    out = f"{gcs_bucket}/p/run-1/echo"
    assert run_step("echo", _echo_step, ["--output", out, "--input", f"data={uri}", "--cache-key", "K2"]) == 2
    err = capsys.readouterr().err
    assert repr(name) in err and uri in err and "Traceback" not in err
    assert all_files(cwd_and_scratch) == []
    assert list(gcs.client().list_blobs(gcs.split_uri(out)[0], prefix=gcs.split_uri(out)[1])) == []


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_object_name_under_a_source_prefix_is_refused_before_any_download(
    gcs_bucket: str, cwd_and_scratch: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    source = f"{gcs_bucket}/data"
    blob(f"{source}/!first.jsonl").upload_from_string(b"{}")
    hostile_blob(source, name).upload_from_string(b"pwned")
    for call in (
        lambda: artifacts.source_files(source),
        lambda: artifacts.fetch_source(source, cwd_and_scratch / "work" / "dest"),
        lambda: runner.input_fingerprints({"train": source}),  # the runner's cache key: before any step runs
    ):
        with pytest.raises(UnsafeNameError) as err:
            call()
        assert repr(name) in str(err.value) and f"source {source}" in str(err.value)
    out = f"{gcs_bucket}/p/run-1/echo"
    assert run_step("echo", _echo_step, ["--output", out, "--input", f"data={source}"]) == 2
    assert repr(name) in capsys.readouterr().err
    assert all_files(cwd_and_scratch) == []


def test_a_symlink_already_in_the_folder_does_not_carry_a_download_outside(gcs_bucket: str, tmp_path: Path) -> None:
    source = f"{gcs_bucket}/data"
    blob(f"{source}/link/train.jsonl").upload_from_string(b"{}")
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "link").symlink_to(outside)
    with pytest.raises(UnsafeNameError, match=r"outside .* \(through a symlink there\)"):
        artifacts.fetch_source(source, dest)
    assert all_files(outside) == []


@pytest.mark.parametrize("name", HOSTILE)
def test_checkpoint_restore_refuses_a_hostile_marker(gcs_bucket: str, tmp_path: Path, name: str) -> None:
    remote = f"{gcs_bucket}/p/run-1/lora_sft/_checkpoints"
    hostile_blob(f"{remote}/7", name).upload_from_string(b"pwned")
    files = {name: {"size": 5, "crc32c": artifacts.crc32c_file(_write(tmp_path / "b", b"pwned"))}}
    artifacts.write_json(f"{remote}/7/{checkpoint_sync.MARKER}", {"step": 7, "files": files})
    local = tmp_path / "work" / "ckpt"
    with pytest.raises(UnsafeNameError) as err:
        checkpoint_sync.download_latest(remote, local)
    assert repr(name) in str(err.value) and f"{remote}/7/{checkpoint_sync.MARKER}" in str(err.value)
    assert not (tmp_path / "work").exists()


def test_checkpoint_steps_are_ascii_digits_only(gcs_bucket: str) -> None:
    remote = f"{gcs_bucket}/ck"
    for step in ("3", "²", "٣"):  # str.isdigit() is true for all three; int("²") raises
        artifacts.write_json(f"{remote}/{step}/{checkpoint_sync.MARKER}", {"step": step, "files": {}})
    assert checkpoint_sync.remote_steps(remote) == [3]


def test_a_step_never_uploads_a_name_readers_would_refuse(gcs_bucket: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write(out / "a.txt", b"1")
    _write(out / "odd\\name", b"2")
    with pytest.raises(UnsafeNameError, match=re.escape(repr("odd\\name")) + ".*Nothing was uploaded"):
        artifacts.upload_tree(out, f"{gcs_bucket}/p/r/s")
    assert list(gcs.client().list_blobs(gcs.split_uri(gcs_bucket)[0], prefix=gcs.split_uri(gcs_bucket)[1])) == []


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------ the hand-off version name


@PROPERTY
@given(version=st.text(max_size=20))
def test_a_handoff_version_is_one_plain_segment(version: str) -> None:
    try:
        handoff.check_version(version)
    except handoff.HandoffError as exc:
        assert repr(version) in str(exc)
        return
    assert "/" not in version and "\n" not in version and version not in (".", "..") and version.isascii()


def test_a_handoff_version_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(handoff.HandoffError, match=r"'v1\\n' is not a valid name"):
        handoff.check_version("v1\n")


# ------------------------------------------------------------------------------ cache entries


def committed(tmp_path: Path, prefix: str, stage: str, key: str) -> artifacts.Manifest:
    src = _write(tmp_path / f"src-{abs(hash(prefix))}" / "a.txt", b"abc").parent
    table = artifacts.upload_tree(src, prefix)
    return artifacts.commit(
        prefix, table, stage=stage, inputs={}, config={}, lock_version="L", cache_key=key, summary={}
    )


@pytest.fixture
def root(gcs_bucket: str) -> str:
    return f"{gcs_bucket}/artifacts"


def test_a_cache_entry_pointing_at_a_commit_of_its_stage_is_a_hit(root: str, tmp_path: Path) -> None:
    m = committed(tmp_path, f"{root}/other-pipeline/run-1/convert_checkpoint-0123456789ab", "convert_checkpoint", "K")
    artifacts.cache_store(root, "convert_checkpoint", "K", m)
    hit = artifacts.cache_lookup(root, "convert_checkpoint", "K")
    assert hit is not None and hit.uri == m.uri


@pytest.mark.parametrize(
    ("pointer", "why"),
    [
        (
            "{root}/tiny/run-1/validate_data/_MANIFEST.json",
            "a commit of 'validate_data', not of stage convert_checkpoint",
        ),
        ("{bucket}/elsewhere/tiny/run-1/convert_checkpoint/_MANIFEST.json", "outside the artifact root"),
        ("{root}/_registry/tiny/run-1/convert_checkpoint/_MANIFEST.json", "is not"),
        ("{root}/tiny/run-1/convert_checkpoint/../../x/convert_checkpoint/_MANIFEST.json", "'..' segments"),
        ("{root}/tiny/run-1/convert_checkpoint/data.json", "is not"),
        ("gs://another-bucket/artifacts/tiny/run-1/convert_checkpoint/_MANIFEST.json", "outside the artifact root"),
        (7, "not a gs:// URI"),
    ],
    ids=["another-stage", "outside-root", "registry", "dot-dot", "not-a-manifest", "another-bucket", "not-a-uri"],
)
def test_a_cache_entry_pointing_anywhere_else_is_a_miss_and_the_log_says_why(
    root: str, gcs_bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, pointer, why: str
) -> None:
    if isinstance(pointer, str):
        pointer = pointer.format(root=root, bucket=gcs_bucket)
        if pointer.startswith(gcs_bucket) and ".." not in pointer and pointer.endswith(artifacts.MANIFEST):
            # a whole, committed manifest with the very key: only where it lies makes it wrong
            committed(tmp_path, pointer.rsplit("/", 1)[0], "convert_checkpoint", "K")
    artifacts.write_json(artifacts.cache_entry_uri(root, "convert_checkpoint", "K"), {"manifest": pointer})
    with caplog.at_level(logging.WARNING, logger="loraflow.storage.artifacts"):
        assert artifacts.cache_lookup(root, "convert_checkpoint", "K") is None
    assert why in caplog.text and "treating it as a miss" in caplog.text


def test_a_cache_entry_whose_manifest_claims_another_stage_is_a_miss(root: str, tmp_path: Path) -> None:
    committed(tmp_path, f"{root}/tiny/run-1/convert_checkpoint", "validate_data", "K")
    pointer = f"{root}/tiny/run-1/convert_checkpoint/_MANIFEST.json"
    artifacts.write_json(artifacts.cache_entry_uri(root, "convert_checkpoint", "K"), {"manifest": pointer})
    assert artifacts.cache_lookup(root, "convert_checkpoint", "K") is None


def test_garbage_in_a_cache_entry_is_a_miss(root: str) -> None:
    for body in (b"not json", b"[1, 2]", b'{"manifest": null}'):
        blob(artifacts.cache_entry_uri(root, "lora_sft", "K")).upload_from_string(body)
        assert artifacts.cache_lookup(root, "lora_sft", "K") is None


def test_the_cache_never_stores_a_pointer_it_would_refuse(root: str, gcs_bucket: str, tmp_path: Path) -> None:
    m = committed(tmp_path, f"{gcs_bucket}/elsewhere/run-1/lora_sft", "lora_sft", "K")
    with pytest.raises(ArtifactError, match="outside the artifact root"):
        artifacts.cache_store(root, "lora_sft", "K", m)
    assert artifacts.read_json(artifacts.cache_entry_uri(root, "lora_sft", "K")) is None


# ------------------------------------------------------------------------------ registry aliases


def test_a_champion_registered_as_publish_writes_it_is_read_with_its_verified_evaluation(
    root: str, tmp_path: Path
) -> None:
    champ = register_champion(f"{root}/_registry", root, tmp_path)
    champion = registry.champion(f"{root}/_registry", "tiny", root)
    assert champion is not None and champion["version"] == 1 and champion["version_uri"] == champ.version_uri
    assert champion["model_manifest"] == champ.model.uri and champion["model_fingerprint"] == champ.model.fingerprint
    assert champion["evaluation_manifest"] == champ.evaluation.uri and champion["gate_manifest"] == champ.gate.uri
    # a version registered before publish recorded its gate: its run's gate commit
    register_champion(f"{root}/_registry", root, tmp_path, run="run-2", entry={"gate_manifest": None})
    older = registry.champion(f"{root}/_registry", "tiny", root)
    assert older is not None and older["gate_manifest"] == f"{root}/tiny/run-2/gate/_MANIFEST.json"
    # a model and its evaluation reused from another pipeline's run (cache hits): its own run's gate ties them
    reused = register_champion(f"{root}/_registry", root, tmp_path, run="run-3", model_at=("other", "run-9"))
    champion = registry.champion(f"{root}/_registry", "tiny", root)
    assert champion is not None and champion["model_manifest"] == reused.model.uri
    assert reused.model.uri.startswith(f"{root}/other/run-9/") and champion["gate_manifest"] == reused.gate.uri


@pytest.mark.parametrize(
    ("alias", "model", "says"),
    [
        ({"version_uri": "{bucket}/crafted/0001.json"}, None, "not at this registry's"),
        ({"version_uri": "{root}/_registry/other/versions/0001.json"}, None, "not at this registry's"),
        ({"version": "1"}, None, "not a version number"),
        ({"version": 0}, None, "not a version number"),
        ({}, "{root}/tiny/run-1/evaluate_tuned/_MANIFEST.json", "not of stage merge_adapter"),
        ({}, "{bucket}/elsewhere/tiny/run-1/merge_adapter/_MANIFEST.json", "outside the artifact root"),
        ({"model_manifest": "gs://x/tiny/run-1/merge_adapter/_MANIFEST.json"}, None, "outside the artifact root"),
        ({}, "{root}/other/run-1/merge_adapter/_MANIFEST.json", "judged an evaluation of the model"),
        ({}, "{root}/tiny/run-7/merge_adapter/_MANIFEST.json", "does not exist"),
    ],
    ids=[
        "crafted-version",
        "other-pipeline",
        "version-text",
        "version-zero",
        "another-stage",
        "outside",
        "alias-model",
        "another-pipelines-model",
        "no-such-model",
    ],
)
def test_a_champion_alias_pointing_elsewhere_is_refused(
    root: str, gcs_bucket: str, tmp_path: Path, alias: dict, model: str | None, says: str
) -> None:
    fill = {"root": root, "bucket": gcs_bucket}
    alias = {k: v.format(**fill) if isinstance(v, str) else v for k, v in alias.items()}
    artifacts.write_json(f"{gcs_bucket}/crafted/0001.json", {"version": 1, "metrics": {"accuracy": 1.0}})
    other = committed_model(root, "other", "run-1", tmp_path)  # another pipeline's real merge_adapter commit
    entry = {}
    if model:
        entry = {"model_manifest": model.format(**fill)}
        alias.setdefault("model_manifest", entry["model_manifest"])
        if entry["model_manifest"] == other.uri:  # its true fingerprint, as a careful forger writes it
            entry["model_fingerprint"] = other.fingerprint
    register_champion(f"{root}/_registry", root, tmp_path, entry=entry, alias=alias)
    with pytest.raises(ArtifactError, match=says) as err:
        registry.champion(f"{root}/_registry", "tiny", root)
    assert registry.alias_uri(f"{root}/_registry", "tiny") in str(err.value) and "repair it" in str(err.value)


def _forge(case: str, root: str, tmp_path: Path) -> dict:
    """What a bucket writer changes in an otherwise whole champion's version entry (the champion's own model
    and evaluation are committed under run-1)."""
    champions_eval = f"{root}/tiny/run-1/evaluate_tuned/_MANIFEST.json"
    if case == "model-fingerprint":
        return {"model_fingerprint": "0" * 64}
    if case == "no-run":
        return {"run_id": None, "gate_manifest": None}
    if case == "no-gate":  # a run that never committed its gate
        return {"run_id": "run-8", "gate_manifest": None}
    if case == "gate-of-another-run":
        committed_gate(root, "tiny", "run-2", champions_eval, tmp_path)
        return {"gate_manifest": f"{root}/tiny/run-2/gate/_MANIFEST.json"}
    if case == "gate-of-another-pipeline":
        committed_gate(root, "other", "run-1", champions_eval, tmp_path)
        return {"gate_manifest": f"{root}/other/run-1/gate/_MANIFEST.json"}
    if case == "gate-not-a-uri":
        return {"gate_manifest": ["gs://b/x"]}
    if case == "gate-did-not-promote":
        committed_gate(root, "tiny", "run-4", champions_eval, tmp_path, promote=False)
        return {"run_id": "run-4", "gate_manifest": None}
    if case == "gate-judged-another-model":
        other = committed_model(root, "tiny", "run-2", tmp_path, b"other weights")
        evaluation = committed_evaluation(root, "tiny", "run-2", other, "1" * 100, tmp_path)
        committed_gate(root, "tiny", "run-2", evaluation.uri, tmp_path)
        return {"run_id": "run-2", "gate_manifest": None}
    if case == "gate-judged-another-stage":
        committed_gate(root, "tiny", "run-5", f"{root}/tiny/run-1/merge_adapter/_MANIFEST.json", tmp_path)
        return {"run_id": "run-5", "gate_manifest": None}
    assert case == "gate-judged-nothing-committed"
    committed_gate(root, "tiny", "run-6", f"{root}/tiny/run-3/evaluate_tuned/_MANIFEST.json", tmp_path)
    return {"run_id": "run-6", "gate_manifest": None}


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("model-fingerprint", "its model's files have fingerprint"),
        ("no-run", "it names no run of tiny"),
        ("no-gate", r"its run's gate \S+ does not exist"),
        ("gate-of-another-run", "is not a commit of its own run"),
        ("gate-of-another-pipeline", "is not a commit of its own run"),
        ("gate-not-a-uri", "not a gs:// URI"),
        ("gate-did-not-promote", "did not promote it"),
        ("gate-judged-another-model", "judged an evaluation of the model"),
        ("gate-judged-another-stage", "not of stage evaluate_tuned"),
        ("gate-judged-nothing-committed", "does not exist"),
    ],
)
def test_a_champion_the_gate_cannot_verify_is_refused_naming_the_version_and_the_repair(
    root: str, tmp_path: Path, case: str, says: str
) -> None:
    champ = register_champion(f"{root}/_registry", root, tmp_path, entry=_forge(case, root, tmp_path))
    with pytest.raises(ArtifactError, match=says) as err:
        registry.champion(f"{root}/_registry", "tiny", root)
    message = str(err.value)
    assert f"version 1 ({champ.version_uri})" in message, message
    assert "repair it" in message and "delete" in message and "compare with the base only" in message


def test_registry_objects_are_read_capped_and_garbage_is_refused_naming_the_object(
    root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.cloud.storage import Blob

    champ = register_champion(f"{root}/_registry", root, tmp_path)
    alias_uri = registry.alias_uri(f"{root}/_registry", "tiny")
    read, real = [], Blob.download_as_bytes

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = real(self, *args, **kwargs)
        read.append((self.name, len(data)))
        return data

    monkeypatch.setattr(Blob, "download_as_bytes", counted)
    huge = json.dumps({"version": 1, "pad": "x" * (3 << 20)}).encode()
    blob(alias_uri).upload_from_string(huge)
    with pytest.raises(ArtifactError, match=r"larger than") as err:
        registry.champion(f"{root}/_registry", "tiny", root)
    assert alias_uri in str(err.value) and "repair it" in str(err.value)
    assert read and max(n for _, n in read) <= registry.ALIAS_MAX_BYTES + 1  # never the whole object
    artifacts.write_json(alias_uri, {"version": 1})
    for garbage, says in ((b"not json", "not JSON"), (b"[" * 100_000, "not JSON"), (b"[1]", "not a JSON object")):
        blob(champ.version_uri).upload_from_string(garbage)
        with pytest.raises(ArtifactError, match=says) as err:
            registry.champion(f"{root}/_registry", "tiny", root)
        assert champ.version_uri in str(err.value) and "repair it" in str(err.value)


def test_the_gate_is_told_where_the_champions_model_must_lie(parity_spec) -> None:
    from loraflow.pipeline.plan import stage_plans

    assert stage_plans(parity_spec)["gate"].config["artifact_root"] == parity_spec.artifact_root


# ------------------------------------------------------------------------------ inputs vs the cache key


def _argv(out: str, source: str, fingerprint: str, key: str | None = None) -> list[str]:
    key = key or artifacts.cache_key({"data": fingerprint}, {"x": 1}, "L")
    return ["--output", out, "--input", f"data={source}", "--fingerprint", f"data={fingerprint}",
            "--config-json", '{"x": 1}', "--lock-version", "L", "--cache-key", key]  # fmt: skip


def test_a_step_runs_on_inputs_with_the_fingerprints_of_its_key(gcs_bucket: str) -> None:
    source = f"{gcs_bucket}/data"
    blob(f"{source}/train.jsonl").upload_from_string(b"{}")
    fingerprint = runner.input_fingerprints({"data": source})["data"]
    assert run_step("echo", _echo_step, _argv(f"{gcs_bucket}/p/r/echo", source, fingerprint)) == 0
    assert artifacts.read_manifest(f"{gcs_bucket}/p/r/echo").summary["files"] == ["train.jsonl"]


def test_a_source_changed_after_the_key_was_computed_fails_the_step_naming_it(
    gcs_bucket: str, cwd_and_scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = f"{gcs_bucket}/data"
    blob(f"{source}/train.jsonl").upload_from_string(b"{}")
    fingerprint = runner.input_fingerprints({"data": source})["data"]
    blob(f"{source}/train.jsonl").upload_from_string(b'{"changed": 1}')  # between the lookup and the step
    out = f"{gcs_bucket}/p/r/echo"
    assert run_step("echo", _echo_step, _argv(out, source, fingerprint)) == 2
    err = capsys.readouterr().err
    assert f"input data ({source}) is not what cache key" in err and "Re-run the stage" in err
    assert "Traceback" not in err and all_files(cwd_and_scratch) == []
    assert artifacts.read_json(artifacts.manifest_uri(out)) is None


def test_a_key_not_computed_from_the_given_fingerprints_is_refused(
    gcs_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = f"{gcs_bucket}/data"
    blob(f"{source}/train.jsonl").upload_from_string(b"{}")
    fingerprint = runner.input_fingerprints({"data": source})["data"]
    assert run_step("echo", _echo_step, _argv(f"{gcs_bucket}/p/r/echo", source, fingerprint, key="0" * 32)) == 2
    assert "is not the cache key of the given --fingerprint values" in capsys.readouterr().err


def test_the_runner_passes_the_fingerprints_its_key_was_computed_from_and_a_change_is_never_cached(
    parity_spec, cwd_and_scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole path: prepare_stage computes the key (a miss), the train set changes, the step program
    runs with the runner's argv and refuses; nothing is committed, nothing cached under that key."""
    from loraflow.steps import validate_data

    prepared = runner.prepare_stage(parity_spec, "validate_data", "run-1", {}, lambda _line: None)
    assert isinstance(prepared, runner.PreparedStage)
    argv = prepared.argv("python")[3:]
    assert [a for a in argv if a.startswith("train=")][-1] == f"train={prepared.fingerprints['train']}"
    blob(parity_spec.data.train).upload_from_string(b'{"prompt": "1+1", "completion": "2"}\n')
    assert run_step("validate_data", validate_data.run, argv) == 2
    assert (
        f"input train ({parity_spec.data.train}) is not what cache key {prepared.cache_key}" in capsys.readouterr().err
    )
    assert artifacts.read_json(artifacts.manifest_uri(prepared.prefix)) is None
    assert artifacts.cache_lookup(parity_spec.artifact_root, "validate_data", prepared.cache_key) is None
    with pytest.raises(ArtifactError, match="no committed artifact"):
        runner.finish_stage(parity_spec, "validate_data", prepared.prefix, prepared.cache_key)
    assert os.listdir(cwd_and_scratch / "work" / "scratch") == []


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/outside.safetensors"])
def test_a_safetensors_index_may_name_shards_only_inside_its_checkpoint(tmp_path: Path, shard: str) -> None:
    """The index of a Hugging Face checkpoint comes from the bucket too: merge and evaluate read only
    what lies inside the checkpoint folder."""
    from loraflow.lora.safetensors_io import INDEX_FILE, Checkpoint

    checkpoint = tmp_path / "ckpt"
    _write(checkpoint / INDEX_FILE, json.dumps({"weight_map": {"w": shard}}).encode())
    with pytest.raises(UnsafeNameError) as err:
        Checkpoint.open(checkpoint)
    assert repr(shard) in str(err.value) and str(checkpoint / INDEX_FILE) in str(err.value)


# ------------------------------------------------------------------------------ gs:// URIs


@PROPERTY
@given(uri=st.one_of(st.text(max_size=40), st.text(max_size=40).map(lambda t: "gs://" + t)))
def test_a_uri_split_uri_accepts_names_a_bucket_and_a_path_that_cannot_escape(uri: str) -> None:
    try:
        bucket, path = gcs.split_uri(uri)
    except artifacts.ArtifactError as exc:
        assert repr(uri) in str(exc)
        return
    assert uri == f"gs://{bucket}" + (f"/{path}" if path or uri.endswith("/") else "")
    assert bucket and "/" not in bucket
    assert not {".", ".."} & set(path.split("/")) and not {"\r", "\n", "\x00"} & set(uri)
