"""A bucket writer's JSON (docs/security.md): every JSON object read from GCS, and each row of a guard set,
goes through one parser (loraflow/storage/json_objects.py). A list, nesting 100,000 deep, bytes that are
not JSON or not UTF-8 and an oversized object are refused naming the object, and each reader turns the
refusal into what its docs promise: the cache a miss that says why, the champion a refusal naming the alias
and the repair, ``registry promote`` a refused version, ``verify`` one line and exit 1.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow import cli
from loraflow.errors import ArtifactError
from loraflow.evaluation import guard
from loraflow.pipeline import runner
from loraflow.registry import operations
from loraflow.registry import store as registry
from loraflow.steps import gate
from loraflow.storage import artifacts, gcs, json_objects

from .champions import register_champion
from .test_gate import write_eval

CAP = 4096  # the document cap in the "oversized" case: a real manifest of these tests is well under it
GARBAGE = {
    "list": (b"[]", "is not a JSON object (it holds a list)"),
    "deep-list": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 64 levels"),
    "deep-object": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper than 64 levels"),
    "not-json": (b"not json", "is not JSON (Expecting value"),
    "not-utf8": (b'{"format": "\xff"}', "not UTF-8: byte 0xff at offset 12"),
    "oversized": (json.dumps({"pad": "x" * CAP}).encode(), f"is larger than {CAP} bytes"),
}


@pytest.fixture(params=sorted(GARBAGE))
def garbage(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, str]:
    if request.param == "oversized":  # 16 MiB are not uploaded for each reader: the cap is lowered instead
        monkeypatch.setattr(json_objects, "DOCUMENT_MAX_BYTES", CAP)
    return GARBAGE[request.param]


def put(uri: str, data: bytes) -> None:
    bucket, path = gcs.split_uri(uri)
    gcs.client().bucket(bucket).blob(path).upload_from_string(data)


# ------------------------------------------------------------------------------------ the parser


def test_nesting_is_counted_outside_strings_and_the_limit_is_inclusive() -> None:
    limit = json_objects.MAX_DEPTH
    at_limit = '{"a":' * limit + "1" + "}" * limit
    assert json_objects.nesting_depth(at_limit) == limit and json_objects.parse_object(at_limit)["a"]
    with pytest.raises(json_objects.NotAnObject, match=f"nested deeper than {limit} levels"):
        json_objects.parse_object('{"a":' * (limit + 1) + "1" + "}" * (limit + 1))
    in_strings = {"a": "[" * 100_000, "b": '\\"{{{', "c": "\\", "d": [[]]}
    assert json_objects.parse_object(json.dumps(in_strings)) == in_strings
    assert json_objects.nesting_depth(json.dumps(in_strings)) == 3  # the object, d, d[0]
    assert json_objects.nesting_depth("") == 0 and json_objects.nesting_depth("[][][]") == 1


@pytest.mark.parametrize("kind", ["list", "deep-list", "deep-object", "not-json", "not-utf8"])
def test_the_parser_refuses_with_a_value_error_never_a_recursion_error(kind: str) -> None:
    data, says = GARBAGE[kind]
    with pytest.raises(json_objects.NotAnObject) as err:
        json_objects.parse_object(data)
    assert says in str(err.value) and isinstance(err.value, ValueError)


def test_a_string_number_and_null_are_not_objects() -> None:
    for text, held in (('"x"', "str"), ("7", "int"), ("null", "NoneType"), ("", None)):
        with pytest.raises(json_objects.NotAnObject) as err:
            json_objects.parse_object(text)
        assert (f"it holds a {held}" if held else "is not JSON") in str(err.value)


def test_a_local_file_is_read_with_the_same_bounds(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    path.write_bytes(b'{"accuracy": 0.5}')
    assert json_objects.read_file_object(path) == {"accuracy": 0.5}
    assert json_objects.read_file_object(path, max_bytes=17) == {"accuracy": 0.5}
    with pytest.raises(json_objects.JsonObjectError, match=rf"{path} is larger than 16 bytes; re-run"):
        json_objects.read_file_object(path, max_bytes=16, fix="re-run")
    path.write_bytes(GARBAGE["deep-list"][0])
    with pytest.raises(json_objects.JsonObjectError, match=rf"^{path} is not JSON .*nested deeper.*restore it"):
        json_objects.read_file_object(path)


def test_a_local_file_that_is_not_utf8_is_refused_with_the_callers_fix(tmp_path: Path) -> None:
    path = tmp_path / "decision.json"
    path.write_bytes(GARBAGE["not-utf8"][0])
    with pytest.raises(json_objects.JsonObjectError, match=r"not UTF-8: byte 0xff at offset 12\); re-run the gate$"):
        json_objects.read_file_object(path, fix="re-run the gate")


# ------------------------------------------------------------------------------------ the readers


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many bytes each GCS download returned."""
    from google.cloud.storage import Blob

    got: list[int] = []
    real = Blob.download_as_bytes

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = real(self, *args, **kwargs)
        got.append(len(data))
        return data

    monkeypatch.setattr(Blob, "download_as_bytes", counted)
    return got


def test_an_object_listed_over_its_cap_is_refused_before_a_byte_is_read(gcs_bucket: str, downloads: list[int]) -> None:
    uri = f"{gcs_bucket}/_cache/lora_sft/K.json"
    body = json.dumps({"manifest": "x" * 80}).encode()
    put(uri, body)
    bucket, path = gcs.split_uri(uri)
    listed = gcs.client().bucket(bucket).get_blob(path)  # its size known, as a listing gives it
    assert json_objects.read_json_object(uri, max_bytes=len(body), blob=listed) == json.loads(body)
    downloads.clear()
    with pytest.raises(json_objects.JsonObjectError) as err:
        json_objects.read_json_object(uri, max_bytes=len(body) - 1, blob=listed)
    assert str(err.value).startswith(f"{uri} is larger than {len(body) - 1} bytes ({len(body)});")
    assert downloads == []


def test_an_object_is_read_only_up_to_its_cap(gcs_bucket: str, downloads: list[int]) -> None:
    uri = f"{gcs_bucket}/x/_MANIFEST.json"
    body = json.dumps({"pad": "x" * 200_000}).encode()
    put(uri, body)
    with pytest.raises(json_objects.JsonObjectError, match=f"^{uri} is larger than 1000 bytes;"):
        json_objects.read_json_object(uri, max_bytes=1000)
    assert downloads == [1001]  # a ranged read: the cap and one byte more, never the object
    assert json_objects.read_json_object(uri, max_bytes=len(body)) == json.loads(body)  # the cap itself is allowed


def test_an_empty_object_is_not_json_and_a_missing_one_is_none(gcs_bucket: str) -> None:
    put(f"{gcs_bucket}/empty.json", b"")
    with pytest.raises(json_objects.JsonObjectError, match=r"empty\.json is not JSON \(Expecting value"):
        json_objects.read_json_object(f"{gcs_bucket}/empty.json")
    assert json_objects.read_json_object(f"{gcs_bucket}/missing.json") is None


def committed(tmp_path: Path, prefix: str, stage: str, key: str) -> artifacts.Manifest:
    src = tmp_path / f"src-{abs(hash(prefix))}"
    src.mkdir()
    (src / "a.txt").write_bytes(b"abc")
    table = artifacts.upload_tree(src, prefix)
    return artifacts.commit(
        prefix, table, stage=stage, inputs={}, config={}, lock_version="L", cache_key=key, summary={}
    )


def test_read_manifest_refuses_a_bad_manifest_naming_it(gcs_bucket: str, garbage: tuple[bytes, str]) -> None:
    data, says = garbage
    uri = f"{gcs_bucket}/tiny/run-1/lora_sft/_MANIFEST.json"
    put(uri, data)
    with pytest.raises(json_objects.JsonObjectError) as err:
        artifacts.read_manifest(uri)
    assert str(err.value).startswith(f"{uri} ") and says in str(err.value) and "re-run" in str(err.value)


def test_a_bad_manifest_behind_a_cache_entry_is_a_miss_and_the_log_says_why(
    gcs_bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, garbage: tuple[bytes, str]
) -> None:
    data, says = garbage
    root = f"{gcs_bucket}/artifacts"
    manifest = committed(tmp_path, f"{root}/tiny/run-1/lora_sft", "lora_sft", "K")
    artifacts.cache_store(root, "lora_sft", "K", manifest)
    put(manifest.uri, data)
    with caplog.at_level(logging.WARNING, logger="loraflow.storage.artifacts"):
        assert artifacts.cache_lookup(root, "lora_sft", "K") is None
    assert f"cache entry {artifacts.cache_entry_uri(root, 'lora_sft', 'K')} is stale: {manifest.uri} " in caplog.text
    assert says in caplog.text and "treating it as a miss" in caplog.text


def test_a_bad_cache_entry_is_a_miss_and_the_log_says_why(
    gcs_bucket: str, caplog: pytest.LogCaptureFixture, garbage: tuple[bytes, str]
) -> None:
    data, says = garbage
    cap = json_objects.SMALL_MAX_BYTES  # an entry is held to the small cap: 100,000 levels are over it
    if says.startswith("is larger"):
        data, says = json.dumps({"manifest": "x" * cap}).encode(), f"is larger than {cap} bytes"
    elif "nested" in says:
        data = b"[" * 10_000 + b"]" * 10_000  # deeper than json.loads can go (RecursionError), under the cap
    root = f"{gcs_bucket}/artifacts"
    entry = artifacts.cache_entry_uri(root, "lora_sft", "K")
    put(entry, data)
    with caplog.at_level(logging.WARNING, logger="loraflow.storage.artifacts"):
        assert artifacts.cache_lookup(root, "lora_sft", "K") is None
    assert f"cache entry {entry} is refused: it " in caplog.text and says in caplog.text
    assert "treating it as a miss" in caplog.text


def test_the_next_commit_goes_beside_a_bad_manifest(gcs_bucket: str, garbage: tuple[bytes, str]) -> None:
    prefix = f"{gcs_bucket}/artifacts/tiny/run-1/lora_sft"
    put(f"{prefix}/_MANIFEST.json", garbage[0])
    assert runner.commit_prefix(prefix, "abcdef0123456789") == f"{prefix}-abcdef012345"


def test_a_champion_with_a_bad_manifest_is_refused_naming_the_alias_and_the_repair(
    gcs_bucket: str, tmp_path: Path, garbage: tuple[bytes, str]
) -> None:
    data, says = garbage
    root, registry_uri = f"{gcs_bucket}/artifacts", f"{gcs_bucket}/_registry"
    champ = register_champion(registry_uri, root, tmp_path)
    for bad in (champ.model, champ.gate, champ.evaluation):
        put(bad.uri, data)
        with pytest.raises(ArtifactError) as err:
            registry.champion(registry_uri, "tiny", root)
        message = str(err.value)
        assert registry.alias_uri(registry_uri, "tiny") in message and bad.uri in message and says in message
        assert "repair it" in message and "delete it to compare with the base only" in message
        put(bad.uri, json.dumps(bad.data).encode())


def test_the_gate_fails_on_a_champion_with_a_bad_manifest_naming_the_alias(
    gcs_bucket: str, tmp_path: Path, make_ctx: Callable, garbage: tuple[bytes, str]
) -> None:
    data, says = garbage
    champ = register_champion(f"{gcs_bucket}/_registry", f"{gcs_bucket}/artifacts", tmp_path, accuracy=0.5)
    put(champ.model.uri, data)
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5),
    }
    config = {"min_improvement": 0.3, "registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny",
              "artifact_root": f"{gcs_bucket}/artifacts"}  # fmt: skip
    with pytest.raises(ArtifactError) as err:
        gate.run(make_ctx("gate", inputs, config))
    message = str(err.value)
    assert registry.alias_uri(f"{gcs_bucket}/_registry", "tiny") in message and says in message
    assert "repair it" in message


def test_the_gate_refuses_an_evaluation_whose_metrics_file_is_not_an_object(tmp_path: Path, make_ctx: Callable) -> None:
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5),
    }
    for data, says in (GARBAGE["deep-object"], GARBAGE["list"]):
        (inputs["tuned_eval"] / "metrics.json").write_bytes(data)
        with pytest.raises(ArtifactError) as err:
            gate.run(make_ctx("gate", inputs, {"min_improvement": 0.3}))
        assert str(inputs["tuned_eval"] / "metrics.json") in str(err.value) and says in str(err.value)


def test_promote_refuses_a_version_whose_model_manifest_is_bad(
    gcs_bucket: str, tmp_path: Path, garbage: tuple[bytes, str]
) -> None:
    data, says = garbage
    root, registry_uri = f"{gcs_bucket}/artifacts", f"{gcs_bucket}/_registry"
    first = register_champion(registry_uri, root, tmp_path, run="run-1", version=1)
    register_champion(registry_uri, root, tmp_path, run="run-2", version=2)
    put(first.model.uri, data)
    reg = operations.PipelineRegistry(registry_uri, "tiny", root)
    with pytest.raises(operations.VersionDoesNotVerify, match=r"version 1 .* does not verify") as err:
        operations.promote(reg, 1, actor="a", reason="r", via="cli")
    assert first.model.uri in str(err.value) and says in str(err.value)
    assert registry.champion(registry_uri, "tiny", root)["version"] == 2  # type: ignore[index]


def test_verify_says_in_one_line_what_is_wrong_with_the_manifest(
    gcs_bucket: str, capsys: pytest.CaptureFixture[str], garbage: tuple[bytes, str]
) -> None:
    data, says = garbage
    prefix = f"{gcs_bucket}/p/run-1/merge_adapter"
    put(f"{prefix}/_MANIFEST.json", data)
    assert cli.main(["verify", prefix]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prefix}/_MANIFEST.json ") and says in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------ guard sets


def test_a_guard_row_nested_100000_deep_is_refused_naming_its_line(tmp_path: Path) -> None:
    good = json.dumps({"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 1})
    path = tmp_path / "mine.jsonl"
    path.write_bytes(f"{good}\n".encode() + GARBAGE["deep-object"][0] + b"\n")
    with pytest.raises(guard.GuardSetError, match=r"mine\.jsonl:2: is not JSON .*nested deeper than 64 levels"):
        guard.load_questions(path)


def test_a_guard_set_that_is_not_utf8_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    rows = [{"id": str(i), "question": f"Q{i}?", "choices": ["x", "y"], "answer": 0} for i in range(3)]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in rows]
    lines[1] = lines[1].replace(b"Q1?", b"Q1\xe9?")  # Latin-1, as a spreadsheet may save it
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(guard.GuardSetError, match=r"latin\.jsonl:2: is not JSON \(not UTF-8: byte 0xe9 at offset"):
        guard.load_questions(path)


def test_a_guard_row_with_a_line_separator_inside_a_string_is_one_row(tmp_path: Path) -> None:
    row = {"id": "a", "question": "Two\u2028lines?", "choices": ["x", "y"], "answer": 1}
    path = tmp_path / "sep.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\r\n", encoding="utf-8")
    assert [q.question for q in guard.load_questions(path)] == ["Two\u2028lines?"]


def test_the_shipped_guard_sets_still_load() -> None:
    for name in guard.SHIPPED:
        assert len(guard.load_questions(guard.shipped_path(name))) >= 100
