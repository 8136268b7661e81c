"""The GCS hand-off contract, against the GCS emulator through the real client library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError, DataValidationError
from loraflow.steps._harness import StepContext, run_step
from loraflow.storage import artifacts, gcs


def blob(uri: str):
    bucket, path = gcs.split_uri(uri)
    return gcs.client().bucket(bucket).blob(path)


def commit_dir(tmp_path: Path, prefix: str, files: dict[str, bytes]) -> artifacts.Manifest:
    src = tmp_path / "src"
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    table = artifacts.upload_tree(src, prefix)
    return artifacts.commit(
        prefix, table, stage="s", inputs={}, config={"a": 1}, lock_version="L", cache_key="K", summary={"n": 1}
    )


def test_commit_then_fetch_round_trip(gcs_bucket: str, tmp_path: Path) -> None:
    prefix = f"{gcs_bucket}/p/run-1/s"
    m = commit_dir(tmp_path, prefix, {"a.bin": b"\x00" * 1000, "sub/b.txt": b"hello"})
    read = artifacts.read_manifest(prefix)
    assert read.files == m.files and read.files["sub/b.txt"]["size"] == 5
    out = artifacts.fetch(read, tmp_path / "out")
    assert (out / "sub" / "b.txt").read_bytes() == b"hello"


def test_a_prefix_without_manifest_is_not_an_artifact(gcs_bucket: str, tmp_path: Path) -> None:
    blob(f"{gcs_bucket}/p/run-1/s/a.bin").upload_from_string(b"partial")
    with pytest.raises(ArtifactError, match=r"_MANIFEST\.json is missing"):
        artifacts.read_manifest(f"{gcs_bucket}/p/run-1/s")


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda b: b.upload_from_string(b"hellO"), "fails its checksum"),
        (lambda b: b.upload_from_string(b"hell"), "has 4 bytes, the manifest says 5"),
        (lambda b: b.delete(), "missing from GCS"),
    ],
    ids=["flipped-byte", "truncated", "deleted"],
)
def test_tampering_is_detected_and_names_the_file(gcs_bucket: str, tmp_path: Path, damage, says: str) -> None:
    prefix = f"{gcs_bucket}/p/run-1/s"
    m = commit_dir(tmp_path, prefix, {"a.bin": b"1234", "sub/b.txt": b"hello"})
    damage(blob(f"{prefix}/sub/b.txt"))
    with pytest.raises(ArtifactError, match=says) as err:
        artifacts.fetch(artifacts.read_manifest(m.uri), tmp_path / "out")
    assert "'sub/b.txt'" in str(err.value)


def test_a_manifest_copied_from_another_run_is_refused(gcs_bucket: str, tmp_path: Path) -> None:
    m = commit_dir(tmp_path, f"{gcs_bucket}/p/run-1/s", {"a.bin": b"x"})
    other = f"{gcs_bucket}/p/run-2/s"
    blob(f"{other}/a.bin").upload_from_string(b"x")
    blob(f"{other}/_MANIFEST.json").upload_from_string(json.dumps(m.data))
    with pytest.raises(ArtifactError, match="copied from another run"):
        artifacts.read_manifest(other)


def test_cache_points_at_a_whole_committed_manifest(gcs_bucket: str, tmp_path: Path) -> None:
    m = commit_dir(tmp_path, f"{gcs_bucket}/p/run-1/s", {"a.bin": b"x"})
    assert artifacts.cache_lookup(gcs_bucket, "s", "K") is None
    artifacts.cache_store(gcs_bucket, "s", "K", m)
    assert artifacts.cache_lookup(gcs_bucket, "s", "K").uri == m.uri
    blob(f"{gcs_bucket}/p/run-1/s/a.bin").upload_from_string(b"y")  # the cached files changed under it
    assert artifacts.cache_lookup(gcs_bucket, "s", "K") is None


def test_cache_key_depends_on_inputs_config_and_lock() -> None:
    base = artifacts.cache_key({"a": "f1"}, {"lr": 1}, "L1")
    assert base == artifacts.cache_key({"a": "f1"}, {"lr": 1}, "L1")
    assert len({base, artifacts.cache_key({"a": "f2"}, {"lr": 1}, "L1"),
                artifacts.cache_key({"a": "f1"}, {"lr": 2}, "L1"),
                artifacts.cache_key({"a": "f1"}, {"lr": 1}, "L2")}) == 4  # fmt: skip


def test_run_ids_become_plain_object_names() -> None:
    assert artifacts.safe_run_id("manual__2026-12-02T21:00:00+00:00") == "manual__2026-12-02T21-00-00-00-00"
    with pytest.raises(ArtifactError):
        artifacts.safe_run_id("::")


# ----------------------------------------------------------------------------- the step harness


def _echo_step(ctx: StepContext) -> dict:
    text = (ctx.inputs["data"] / "in.txt").read_text()
    (ctx.out / "out.txt").write_text(text.upper())
    return {"chars": len(text)}


def _rejecting_step(ctx: StepContext) -> dict:
    (ctx.out / "report.json").write_text('{"failed": 3}')
    raise DataValidationError("3 rows are empty")


def test_harness_fetches_runs_and_commits(gcs_bucket: str) -> None:
    blob(f"{gcs_bucket}/src/in.txt").upload_from_string(b"abc")
    out = f"{gcs_bucket}/p/r/echo"
    argv = [
        "--output",
        out,
        "--input",
        f"data={gcs_bucket}/src/in.txt",
        "--cache-key",
        "K1",
        "--config-json",
        '{"x": 1}',
    ]
    assert run_step("echo", _echo_step, argv) == 0
    m = artifacts.read_manifest(out)
    assert m.summary["chars"] == 3 and m.data["config"] == {"x": 1} and m.data["cache_key"] == "K1"
    assert m.data["inputs"]["data"]["fingerprint"]
    assert blob(f"{out}/out.txt").download_as_bytes() == b"ABC"
    # A retry after the commit is a no-op; a different cache key never overwrites the artifact.
    assert run_step("echo", _echo_step, argv) == 0
    assert run_step("echo", _echo_step, [*argv[:-4], "--cache-key", "K2"]) == 2


def _count_step(ctx: StepContext) -> dict:
    return {"files": sorted(p.name for p in ctx.inputs["data"].iterdir())}


def test_a_manifest_records_each_upstream_by_uri_fingerprint_and_cache_key(gcs_bucket: str) -> None:
    """The cache key is what stands for an upstream stage in a downstream key (runner.input_fingerprints):
    the downstream manifest records it, so two manifests tell whether they were computed from the same inputs."""
    blob(f"{gcs_bucket}/src/in.txt").upload_from_string(b"abc")
    up = f"{gcs_bucket}/p/r/echo"
    assert (
        run_step("echo", _echo_step, ["--output", up, "--input", f"data={gcs_bucket}/src/in.txt", "--cache-key", "K1"])
        == 0
    )
    upstream = artifacts.read_manifest(up)
    down = f"{gcs_bucket}/p/r/count"
    assert (
        run_step("count", _count_step, ["--output", down, "--input", f"data={upstream.uri}", "--cache-key", "K2"]) == 0
    )
    m = artifacts.read_manifest(down)
    assert m.summary["files"] == ["out.txt"]
    assert m.data["inputs"]["data"] == {"uri": upstream.uri, "fingerprint": upstream.fingerprint, "cache_key": "K1"}


def test_a_rejected_step_keeps_evidence_but_commits_nothing(gcs_bucket: str) -> None:
    out = f"{gcs_bucket}/p/r/validate"
    assert run_step("validate", _rejecting_step, ["--output", out]) != 0
    with pytest.raises(ArtifactError):
        artifacts.read_manifest(out)
    assert json.loads(blob(f"{out}/_rejected/report.json").download_as_bytes()) == {"failed": 3}


def test_harness_refuses_a_non_gcs_input(gcs_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_step("echo", _echo_step, ["--output", f"{gcs_bucket}/p/r/e", "--input", "data=/etc/passwd"])
    assert rc == 2
    assert "not a gs:// URI" in capsys.readouterr().err


@pytest.mark.parametrize("uri", ["gs://b/run/../other-run/x", "gs://b/./x", "/etc/passwd", "s3://b/x", "gs:///x"])
def test_uris_that_could_escape_their_prefix_are_refused(uri: str) -> None:
    with pytest.raises(ArtifactError):
        gcs.split_uri(uri)


# ------------------------------------------------------------------- keys, sources, partial fetch


def test_cache_key_ignores_the_order_configs_and_inputs_were_written_in() -> None:
    key = artifacts.cache_key({"a": "f1", "b": "f2"}, {"lr": 1, "opt": {"b": 2, "a": 1}}, "L1")
    assert key == artifacts.cache_key({"b": "f2", "a": "f1"}, {"opt": {"a": 1, "b": 2}, "lr": 1}, "L1")
    assert len(key) == 32 and int(key, 16) >= 0


def test_a_second_commit_of_a_prefix_is_refused_and_the_first_kept(gcs_bucket: str, tmp_path: Path) -> None:
    prefix = f"{gcs_bucket}/p/run-1/s"
    first = commit_dir(tmp_path, prefix, {"a.bin": b"x"})
    with pytest.raises(ArtifactError, match=r"committed by another writer first .* never overwritten"):
        artifacts.commit(prefix, {}, stage="s", inputs={}, config={}, lock_version="L", cache_key="K2", summary={})
    assert artifacts.read_manifest(prefix).data == first.data


def test_a_source_prefix_lists_its_files_by_relative_name(gcs_bucket: str, tmp_path: Path) -> None:
    blob(f"{gcs_bucket}/src/data/a.jsonl").upload_from_string(b"aa")
    blob(f"{gcs_bucket}/src/data/sub/b.jsonl").upload_from_string(b"bbb")
    blob(f"{gcs_bucket}/src/data-other/c.jsonl").upload_from_string(b"c")  # a sibling prefix: not part of it
    blob(f"{gcs_bucket}/src/data/sub/").upload_from_string(b"")  # a folder placeholder: no file
    files = artifacts.source_files(f"{gcs_bucket}/src/data")
    assert artifacts.source_files(f"{gcs_bucket}/src/data/") == files
    assert {n: (m["size"], m["object"].rsplit("/src/", 1)[-1]) for n, m in files.items()} == {
        "a.jsonl": (2, "data/a.jsonl"),
        "sub/b.jsonl": (3, "data/sub/b.jsonl"),
    }
    one = artifacts.source_files(f"{gcs_bucket}/src/data/sub/b.jsonl")
    assert list(one) == ["b.jsonl"] and one["b.jsonl"]["size"] == 3
    got = artifacts.fetch_source(f"{gcs_bucket}/src/data", tmp_path / "d")
    assert got == files and (tmp_path / "d" / "sub" / "b.jsonl").read_bytes() == b"bbb"
    with pytest.raises(ArtifactError, match=f"source {gcs_bucket}/src/nothing does not exist"):
        artifacts.source_files(f"{gcs_bucket}/src/nothing")


def test_fetch_only_downloads_the_named_files(gcs_bucket: str, tmp_path: Path) -> None:
    commit_dir(tmp_path, f"{gcs_bucket}/p/run-1/s", {"a.bin": b"a", "b.bin": b"b", "e.bin": b""})
    m = artifacts.read_manifest(f"{gcs_bucket}/p/run-1/s")  # an empty file (size 0) is a file like any other
    out = artifacts.fetch(m, tmp_path / "out", only=["b.bin", "e.bin"])
    assert sorted(p.name for p in out.iterdir()) == ["b.bin", "e.bin"] and (out / "e.bin").read_bytes() == b""


@pytest.mark.parametrize("size", [-1, True, "5", None], ids=["negative", "bool", "string", "missing"])
def test_a_manifest_whose_file_has_no_valid_size_is_refused(gcs_bucket: str, tmp_path: Path, size) -> None:
    m = commit_dir(tmp_path, f"{gcs_bucket}/p/run-1/s", {"a.bin": b"x"})
    data = json.loads(json.dumps(m.data))
    data["files"]["a.bin"]["size"] = size
    blob(m.uri).upload_from_string(json.dumps(data))
    with pytest.raises(ArtifactError, match=r"file 'a\.bin' has no size and crc32c"):
        artifacts.read_manifest(m.uri)


def test_where_stages_commit_and_the_cache_keeps_its_entries() -> None:
    assert artifacts.stage_prefix("gs://b/root", "tiny", "manual__2026-12-02T21:00:00+00:00", "lora_sft") == (
        "gs://b/root/tiny/manual__2026-12-02T21-00-00-00-00/lora_sft"
    )
    assert artifacts.cache_entry_uri("gs://b/root", "lora_sft", "k1") == "gs://b/root/_cache/lora_sft/k1.json"


def test_a_lock_version_is_the_lock_files_hash(tmp_path: Path) -> None:
    import hashlib

    lock = tmp_path / "control.lock"
    lock.write_bytes(b"numpy==2.0\n")
    assert artifacts.lock_version(lock) == hashlib.sha256(b"numpy==2.0\n").hexdigest()[:16]


def test_the_cache_key_of_given_inputs_is_the_same_in_every_loraflow_version() -> None:
    # A change to how the key is computed misses every cache entry written before it: do it on purpose.
    assert artifacts.cache_key({"a": "f1"}, {"lr": 1}, "L1") == "3045fa6890156dfed1f8cbb03d52eec6"


def test_a_file_downloaded_in_many_pieces_is_checked_whole(gcs_bucket: str, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB: the client writes it in many pieces
    commit_dir(tmp_path, f"{gcs_bucket}/p/run-1/s", {"big.bin": payload})
    out = artifacts.fetch(artifacts.read_manifest(f"{gcs_bucket}/p/run-1/s"), tmp_path / "out")
    assert (out / "big.bin").read_bytes() == payload


def test_a_stale_cache_entry_is_replaced_by_the_next_commit(gcs_bucket: str, tmp_path: Path) -> None:
    first = commit_dir(tmp_path / "1", f"{gcs_bucket}/p/run-1/s", {"a.bin": b"x"})
    artifacts.cache_store(gcs_bucket, "s", "K", first)
    blob(f"{gcs_bucket}/p/run-1/s/a.bin").delete()  # the cached commit lost a file
    assert artifacts.cache_lookup(gcs_bucket, "s", "K") is None
    second = commit_dir(tmp_path / "2", f"{gcs_bucket}/p/run-2/s", {"a.bin": b"x"})
    artifacts.cache_store(gcs_bucket, "s", "K", second)
    assert artifacts.cache_lookup(gcs_bucket, "s", "K").uri == second.uri


def test_names_that_begin_or_end_with_a_capital_x_keep_it(gcs_bucket: str, tmp_path: Path) -> None:
    """Stripping '/' (or '-' and '.') strips only those: a run id, a source folder, an artifact root
    or a committed prefix whose name ends in 'X' keeps it (`strip("XX/XX")` mutants of make mutate)."""
    assert artifacts.safe_run_id("Xmanual__run-X") == "Xmanual__run-X"
    src = tmp_path / "dataX"
    src.mkdir()
    (src / "a.txt").write_text("a")
    table = artifacts.upload_tree(src, f"{gcs_bucket}/srcX/dataX")
    for uri in (f"{gcs_bucket}/srcX/dataX", f"{gcs_bucket}/srcX/dataX/"):
        assert set(artifacts.source_files(uri)) == {"a.txt"}, uri
    prefix = f"{gcs_bucket}/rootX/pipeX/runX/validate_data"
    manifest = artifacts.commit(
        prefix, table, stage="validate_data", inputs={}, config={}, lock_version="L", cache_key="K", summary={}
    )
    assert manifest.data["prefix"] == prefix
    assert artifacts.stage_manifest_problem(manifest.uri, f"{gcs_bucket}/rootX", "validate_data") is None
    assert artifacts.stage_manifest_problem(manifest.uri, f"{gcs_bucket}/rootX/", "validate_data") is None
