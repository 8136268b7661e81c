"""The spec cache behind DAG parsing: an unchanged spec is read back, anything else is validated again."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.errors import SpecError
from loraflow.spec import cache as spec_cache
from loraflow.spec.cache import compiled
from tests.control.test_dags import parse

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    shutil.copy(TINY, folder / TINY.name)
    return folder


def tamper(entry: Path, description: str) -> None:
    """Change what an entry says, keeping its key: only a parse that reads the entry sees the change."""
    data = json.loads(entry.read_text())
    data["spec"]["description"] = description
    entry.write_text(json.dumps(data))


def test_a_cached_spec_is_the_validated_spec(specs: Path, tmp_path: Path) -> None:
    fresh = compiled(specs / TINY.name, cache_dir=tmp_path / "c1")  # validated, written
    again = compiled(specs / TINY.name, cache_dir=tmp_path / "c1")  # read back
    uncached = spec_cache.compile_spec(TINY.read_bytes(), specs / TINY.name)
    assert fresh == again == uncached
    assert next(iter(again.upstream)) == "validate_data"
    assert again.upstream["lora_sft"] == ["convert_checkpoint", "validate_data"]
    assert again.params["training_steps"]["default"] == again.spec["training"]["steps"]


def test_an_unchanged_spec_is_read_from_the_cache_and_an_edited_one_is_validated_again(
    specs: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    path = specs / TINY.name
    compiled(path, cache_dir=cache)
    entry = cache / "tiny-llama-lora.json"
    tamper(entry, "read from the cache")
    assert compiled(path, cache_dir=cache).spec["description"] == "read from the cache"

    path.write_text(TINY.read_text().replace("  steps: ", "  steps: 1", 1))  # an edit: new bytes
    edited = compiled(path, cache_dir=cache)
    assert edited.spec["description"] != "read from the cache"
    steps = spec_cache.compile_spec(TINY.read_bytes(), TINY).spec["training"]["steps"]
    assert edited.spec["training"]["steps"] == int(f"1{steps}")


def test_an_edit_that_breaks_a_cached_spec_is_reported(specs: Path, tmp_path: Path) -> None:
    path = specs / TINY.name
    compiled(path, cache_dir=tmp_path / "cache")
    path.write_text(TINY.read_text().replace("rank: ", "rank: -", 1))
    with pytest.raises(SpecError, match=r"lora\.rank"):
        compiled(path, cache_dir=tmp_path / "cache")
    path.write_bytes(b"name: tiny-llama-lora\n\xff\xfe broken")
    with pytest.raises(SpecError, match="not valid YAML"):
        compiled(path, cache_dir=tmp_path / "cache")


def test_the_same_bytes_under_another_file_name_are_checked_again(specs: Path, tmp_path: Path) -> None:
    compiled(specs / TINY.name, cache_dir=tmp_path / "cache")
    copy = specs / "copy-of-tiny.yaml"
    shutil.copy(TINY, copy)
    with pytest.raises(SpecError, match=r"but the file is copy-of-tiny\.yaml"):
        compiled(copy, cache_dir=tmp_path / "cache")


def test_entries_made_by_other_loraflow_code_are_not_used(
    specs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = specs / TINY.name
    compiled(path, cache_dir=tmp_path / "cache")
    tamper(tmp_path / "cache" / "tiny-llama-lora.json", "made by other code")
    monkeypatch.setattr(spec_cache, "code_fingerprint", lambda: "another loraflow")
    assert compiled(path, cache_dir=tmp_path / "cache").spec["description"] != "made by other code"


def test_the_code_fingerprint_follows_every_loraflow_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "loraflow"
    shutil.copytree(REPO / "loraflow", package, ignore=shutil.ignore_patterns("__pycache__", "native", "steps"))
    monkeypatch.setattr(spec_cache, "_PACKAGE", package)
    spec_cache.code_fingerprint.cache_clear()
    try:
        before = spec_cache.code_fingerprint()
        with (package / "spec" / "stages.py").open("a") as f:
            f.write("\n# a change\n")
        spec_cache.code_fingerprint.cache_clear()
        assert spec_cache.code_fingerprint() != before
    finally:
        spec_cache.code_fingerprint.cache_clear()


def test_validating_a_spec_imports_only_fingerprinted_modules() -> None:
    """The fingerprint hashes the modules of loraflow's fingerprinted packages: validation and planning may
    use no other."""
    code = f"""
import json, sys
from pathlib import Path
from loraflow.spec import cache as spec_cache
spec_cache.compile_spec(Path({str(TINY)!r}).read_bytes(), Path({str(TINY)!r}))
print(json.dumps({{m: getattr(mod, "__file__", None) for m, mod in sys.modules.items() if m.startswith("loraflow")}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "loraflow.spec.schema" in modules and "loraflow.spec.stages" in modules
    allowed = {REPO / "loraflow" / pkg for pkg in spec_cache._FINGERPRINTED}
    outside = {m: f for m, f in modules.items() if f is None or Path(f).parent not in allowed}
    assert outside == {}


def test_a_damaged_entry_is_replaced(specs: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = cache / "tiny-llama-lora.json"
    for damage in (b'{"key": "abc", "spec"', b"\x00\x01", b'{"key": 1}', b"[]"):
        entry.write_bytes(damage)
        assert compiled(specs / TINY.name, cache_dir=cache).name == "tiny-llama-lora"
        assert json.loads(entry.read_text())["key"] == spec_cache.cache_key(TINY.name, TINY.read_bytes())


def test_a_cache_that_cannot_be_written_costs_only_speed(
    specs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="loraflow.spec.cache"):
        for _ in range(2):
            assert compiled(specs / TINY.name, cache_dir=blocked / "specs").name == "tiny-llama-lora"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "LORAFLOW_SPEC_CACHE_DIR" in warnings[0] and "cannot be written" in warnings[0]


def test_where_the_cache_lives(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAFLOW_SPEC_CACHE_DIR", "off")
    assert spec_cache.default_cache_dir() is None
    monkeypatch.setenv("LORAFLOW_SPEC_CACHE_DIR", str(tmp_path / "x"))
    assert spec_cache.default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("LORAFLOW_SPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert spec_cache.default_cache_dir() == tmp_path / "xdg" / "loraflow" / "specs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert spec_cache.default_cache_dir() == tmp_path / "home" / ".cache" / "loraflow" / "specs"


def test_without_a_home_directory_specs_are_validated_every_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, specs: Path
) -> None:
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    for name in ("LORAFLOW_SPEC_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with caplog.at_level(logging.WARNING, logger="loraflow.spec.cache"):
        assert spec_cache.default_cache_dir() is None
        assert compiled(specs / TINY.name).name == "tiny-llama-lora"
    assert "no home directory" in caplog.text and "LORAFLOW_SPEC_CACHE_DIR" in caplog.text


def test_off_writes_nothing(specs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFLOW_SPEC_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiled(specs / TINY.name).name == "tiny-llama-lora"
    assert not (tmp_path / "xdg").exists()


# What a DAG parse built, and whether it loaded the spec models, in a fresh interpreter.
PARSE = r"""
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=os.environ["DAGS"])
dag = bag.dags["tiny-llama-lora"]
print(json.dumps({
    "errors": dict(bag.import_errors),
    "spec_models_loaded": "loraflow.spec.schema" in sys.modules,
    "tasks": {t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks},
    "params": {k: [v.value, v.schema] for k, v in dag.params.items()},
    "retries": {t.task_id: [t.retries, str(t.retry_delay)] for t in dag.tasks},
    "spec": dag.get_task("lora_sft").spec,
    "doc": dag.doc_md, "tags": sorted(dag.tags),
}))
"""


def test_a_dag_from_the_cache_is_the_dag_from_the_spec(specs: Path, tmp_path: Path) -> None:
    cache = {"LORAFLOW_SPEC_CACHE_DIR": str(tmp_path / "cache")}
    first, second = parse(specs, tmp_path, PARSE, **cache), parse(specs, tmp_path, PARSE, **cache)
    assert first["errors"] == {} and first["spec_models_loaded"]
    assert not second["spec_models_loaded"]  # read back: no validation, no pydantic models
    assert (tmp_path / "cache" / "tiny-llama-lora.json").exists()
    first.pop("spec_models_loaded"), second.pop("spec_models_loaded")
    assert first == second
