"""Every hostile spec is refused: the message names the key and the rule it broke, `loraflow validate`
exits non-zero without a traceback and writes nothing, and the DAG folder still loads every other
pipeline beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from loraflow.cli import main
from loraflow.errors import SpecError
from loraflow.spec.schema import load_spec, parse_spec, validate_spec

from .hostile_specs import ACCEPTED, EDITS, alias_bomb, files, tiny_with
from .test_dags import parse

REPO = Path(__file__).resolve().parents[2]
TINY_TEXT = (REPO / "pipelines" / "tiny-llama-lora.yaml").read_bytes()
TINY = yaml.safe_load(TINY_TEXT)
FILES = files(TINY_TEXT)


def write_corpus(folder: Path) -> list[str]:
    """Every hostile spec as a file of ``folder``, named by its id; the ids."""
    folder.mkdir(parents=True, exist_ok=True)
    for ident, edits, _, _ in EDITS:
        (folder / f"{ident}.yaml").write_text(yaml.safe_dump(tiny_with(TINY, ident, edits)))
    for ident, text, _, _ in FILES:
        (folder / f"{ident}.yaml").write_bytes(text)
    return [c[0] for c in EDITS] + [c[0] for c in FILES]


def test_the_corpus_covers_every_lane_of_the_spec_author() -> None:
    paths = " ".join(c[2] for c in EDITS)
    for part in (".env.", "secrets.", ".region", ".project", ".image", ".namespace", "artifact_root", "data."):
        assert part in paths
    assert len(EDITS) + len(FILES) >= 60


@pytest.mark.parametrize(("edits", "where", "says"), [c[1:] for c in EDITS], ids=[c[0] for c in EDITS])
def test_a_hostile_value_is_refused_naming_its_key_and_the_rule(edits: dict, where: str, says: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_spec(tiny_with(TINY, "hostile", edits), "hostile.yaml")
    assert any(path == where and says in msg for path, msg in err.value.problems), err.value.problems


@pytest.mark.parametrize(("text", "where", "says"), [c[1:] for c in FILES], ids=[c[0] for c in FILES])
def test_a_hostile_file_is_refused_before_it_is_validated(text: bytes, where: str, says: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(text, Path("hostile.yaml"))
    assert any(path.startswith(where) and says in msg for path, msg in err.value.problems), err.value.problems


def test_validate_refuses_each_with_the_rule_no_traceback_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "specs"
    idents = write_corpus(folder)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    wanted = {c[0]: (c[2], c[3]) for c in EDITS} | {c[0]: (c[2], c[3]) for c in FILES}
    for ident in idents:
        assert main(["validate", str(folder / f"{ident}.yaml")]) == 1, ident
        out, err = capsys.readouterr()
        where, says = wanted[ident]
        assert "Traceback" not in out + err
        assert f"INVALID  {folder / ident}.yaml" in err and where in err and says in err, (ident, err)
        assert out.strip() == "0 valid, 1 invalid"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_validate_command_on_the_whole_corpus_exits_non_zero_without_a_traceback(tmp_path: Path) -> None:
    folder = tmp_path / "specs"
    idents = write_corpus(folder)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "LORAFLOW_SPEC_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "loraflow.cli", "validate", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr + run.stdout
    assert run.stdout.strip().endswith(f"0 valid, {len(idents)} invalid")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specs"]  # no cache, no home, nothing else


def test_an_alias_bomb_that_validated_before_is_refused_as_written() -> None:
    """The bomb in a param's enum is valid as written (a list of anything): only measuring its expansion
    (10**12 scalars here) refuses it; it is never expanded."""
    plain = yaml.load(TINY_TEXT + alias_bomb(), Loader=yaml.SafeLoader)  # composes fine: nodes are shared
    assert len(plain["params"][0]["enum"]) == 12
    with pytest.raises(SpecError, match=r"more than 100000 YAML nodes once its aliases"):
        parse_spec(TINY_TEXT + alias_bomb(), Path("tiny-llama-lora.yaml"))


def test_the_shipped_specs_keep_their_anchors_and_aliases() -> None:
    """The production spec shares one compute section between two stages with &serving / *serving."""
    text = (REPO / "pipelines" / "llama31-8b-lora.yaml").read_text()
    assert "&serving" in text and "*serving" in text
    spec = load_spec(REPO / "pipelines" / "llama31-8b-lora.yaml")
    assert spec.compute["evaluate_base"] == spec.compute["evaluate_tuned"]


def test_a_fifo_or_a_folder_named_like_a_spec_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    (tmp_path / "folder.yaml").mkdir()
    for path in (fifo, tmp_path / "folder.yaml"):
        with pytest.raises(SpecError, match="is not a regular file"):
            load_spec(path)


def test_the_dag_folder_loads_the_valid_pipeline_beside_every_hostile_spec(tmp_path: Path) -> None:
    folder = tmp_path / "pipelines"
    idents = write_corpus(folder)
    (folder / "tiny-llama-lora.yaml").write_bytes(TINY_TEXT)
    os.mkfifo(folder / "a-fifo.yaml")
    result = parse(folder, tmp_path, LORAFLOW_SPEC_CACHE_DIR=str(tmp_path / "cache"))
    assert result["dags"] == ["loraflow_registry", "tiny-llama-lora"]
    [message] = result["errors"].values()
    for ident in [*idents, "a-fifo"]:
        assert f"{ident}.yaml" in message
    assert "Traceback" not in message


def test_a_spec_that_breaks_loading_in_an_unforeseen_way_is_still_only_its_own_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: whatever a spec raises (not only SpecError), the other pipelines still load."""
    from loraflow.spec import cache as spec_cache
    from operators import dag_factory

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "tiny-llama-lora.yaml").write_bytes(TINY_TEXT)
    (folder / "odd.yaml").write_text("name: odd\n")

    def compiled(path: Path) -> spec_cache.CompiledSpec:
        if path.name == "odd.yaml":
            raise RecursionError("maximum recursion depth exceeded")
        return spec_cache.compiled(path, cache_dir=tmp_path / "cache")

    monkeypatch.setattr(dag_factory, "compiled", compiled)
    dags = dag_factory.load_pipelines(folder)
    assert sorted(dags) == ["_loraflow_invalid_specs", "tiny-llama-lora"]
    message = dags["_loraflow_invalid_specs"].doc_md or ""
    assert "odd.yaml: cannot be loaded (RecursionError: maximum recursion depth exceeded)" in message
    assert "loraflow validate" in message


def test_a_duplicate_key_names_both_lines() -> None:
    text = TINY_TEXT + b"training:\n  steps: 1\n"
    first = TINY_TEXT.decode().splitlines().index("training:") + 1
    second = len(TINY_TEXT.decode().splitlines()) + 1
    with pytest.raises(SpecError) as err:
        parse_spec(text, Path("tiny-llama-lora.yaml"))
    [(where, says)] = err.value.problems
    assert where == f"line {second}"
    assert f"duplicate key 'training' (first at line {first})" in says


def test_every_duplicate_and_tag_is_named_at_once() -> None:
    text = TINY_TEXT + b"retry: {retries: 1, retries: 2}\nnotify: !!set {a}\ntags: [a]\n"
    with pytest.raises(SpecError) as err:
        parse_spec(text, Path("tiny-llama-lora.yaml"))
    says = " | ".join(m for _, m in err.value.problems)
    assert "duplicate key 'retries'" in says and "!!set" in says and "duplicate key 'tags'" in says


def test_merge_keys_and_anchors_are_no_duplicates() -> None:
    from loraflow.spec.reader import load_yaml

    data = load_yaml(b"a: &base {x: 1, y: 2}\nb: {<<: *base, y: 3}\nc: *base\n", "merge.yaml")
    assert data == {"a": {"x": 1, "y": 2}, "b": {"x": 1, "y": 3}, "c": {"x": 1, "y": 2}}


def build(data: dict, tmp_path: Path) -> None:
    """Validate ``data``, build its DAG as the DAG file does and take it through what the DAG processor
    does with it: Airflow's own checks and the serialization written to its database."""
    from airflow.serialization.serialized_objects import DagSerialization

    from loraflow.pipeline.plan import stage_plans
    from loraflow.spec.cache import CompiledSpec
    from loraflow.spec.schema import trigger_fields
    from operators.dag_factory import build_dag

    spec = validate_spec(data, f"{data['name']}.yaml")
    plain = json.loads(json.dumps(spec.model_dump(mode="json"), allow_nan=False))  # as the spec cache holds it
    pipeline = CompiledSpec(plain, {s: list(p.upstream) for s, p in stage_plans(spec).items()}, trigger_fields(spec))
    dag = build_dag(pipeline, tmp_path / f"{spec.name}.yaml")
    dag.validate()
    dag.params.validate()  # the trigger form's defaults hold (Airflow refuses a scheduled DAG whose don't)
    json.dumps(DagSerialization.to_dict(dag), allow_nan=False)


@pytest.mark.parametrize("edits", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_an_unusual_value_the_schema_accepts_builds_a_dag_airflow_takes(edits: dict, tmp_path: Path) -> None:
    build(tiny_with(TINY, "unusual", edits), tmp_path)


def test_the_tag_length_limit_is_airflows() -> None:
    from airflow.sdk.definitions.dag import TAG_MAX_LEN

    from loraflow.spec import fields

    assert fields.TAG_MAX_LEN == TAG_MAX_LEN


_CRON_ITEM = st.one_of(
    st.just("*"),
    st.integers(-1, 62).map(str),
    st.sampled_from(["JAN", "dec", "Feb", "MON", "sun", "Sat", "FOO", "L", "W", "?", "1#2", "LW", "5L"]),
)
_CRON_RANGE = st.tuples(_CRON_ITEM, st.sampled_from(["", "-"]), _CRON_ITEM, st.sampled_from(["", "/"]),
                        st.integers(0, 70)).map(lambda t: t[0] + (t[1] + t[2] if t[1] else "") + (f"/{t[4]}" if t[3] else ""))  # fmt: skip
_CRON_FIELD = st.lists(_CRON_RANGE, min_size=1, max_size=3).map(",".join)


@given(st.lists(_CRON_FIELD, min_size=5, max_size=5).map(" ".join))
@example("0 0 31 2 *")
@example("0 0 30 2 */1")
@example("0 0 31 4,6,9,11 *")
@example("0 0 31 2 1")
@example("0 0 29 2 *")
@example("5-1 * * * *")
def test_a_cron_expression_the_schema_accepts_is_one_airflow_takes_and_that_fires(cron: str) -> None:
    """Five fields of numbers, names, ranges and steps, in and out of range: whatever the schema accepts,
    Airflow's timetable takes and croniter finds the next run of (a cron that never fires is refused)."""
    import datetime as dt

    from airflow.sdk.definitions.timetables.trigger import CronTriggerTimetable
    from croniter import croniter

    try:
        validate_spec(tiny_with(TINY, "cron", {"schedule": cron}), "cron.yaml")
    except SpecError as err:
        assert [p for p, _ in err.problems] == ["schedule"], err.problems
        return
    CronTriggerTimetable(cron, timezone="UTC").validate()
    assert croniter(cron, dt.datetime(2026, 1, 1)).get_next(dt.datetime) > dt.datetime(2026, 1, 1)


def _number_settings(model: type, prefix: str = "") -> list[tuple[str, type]]:
    """Every int or float setting of the spec's sections (their own models, the data contract's too)."""
    from types import UnionType
    from typing import Union, get_args, get_origin

    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        if get_origin(field.annotation) not in (None, Union, UnionType):
            continue  # a list or a mapping of settings: the corpus above covers those
        kinds = {a for a in (field.annotation, *get_args(field.annotation)) if isinstance(a, type)}
        models = [k for k in kinds if issubclass(k, BaseModel)]
        if models:
            out += _number_settings(models[0], f"{prefix}{name}.")
        elif kinds & {int, float} and bool not in kinds:
            out.append((f"{prefix}{name}", float if float in kinds else int))
    return out


def test_every_number_of_the_schema_is_finite_and_bounded() -> None:
    """One check refuses inf, nan and absurd sizes wherever a number sits: no section can forget it."""
    from loraflow.spec.schema import PipelineSpec

    settings = _number_settings(PipelineSpec)
    assert {"training.steps", "lora.alpha", "retry.max_delay_seconds", "data.expectations.row_count.min"} <= {
        path for path, _ in settings
    }
    for path, kind in settings:
        hostile = (
            [float("inf"), float("-inf"), float("nan"), 10**20, 1e20] if kind is float else [10**20, 1e20, -(10**20)]
        )
        for value in hostile:
            with pytest.raises(SpecError) as err:
                validate_spec(tiny_with(TINY, "numbers", {path: value}), "numbers.yaml")
            assert any(p == path and ("finite" in m or "too large" in m) for p, m in err.value.problems), (
                path,
                value,
                err.value.problems,
            )


def test_every_number_of_the_schema_is_a_number_never_a_boolean_or_text() -> None:
    """``max_drop: true`` (or ``yes``) was 1.0, which turned the regression guard off, and ``"0.05"`` was
    taken: every number setting, in every section (the strict base model), refuses both, naming the fix."""
    from loraflow.spec.schema import PipelineSpec

    for path, kind in _number_settings(PipelineSpec):
        for value in (True, False, "1", "0.05"):
            with pytest.raises(SpecError) as err:
                validate_spec(tiny_with(TINY, "numbers", {path: value}), "numbers.yaml")
            wanted = "a whole number such as 100" if kind is int else "a number such as 0.05"
            at_path = [m for p, m in err.value.problems if p == path]
            assert len(at_path) == 1 and wanted in at_path[0], (path, value, err.value.problems)


@pytest.mark.parametrize("written", ["yes", "on", "true", '"0.05"'])
def test_a_yaml_boolean_or_quoted_share_is_no_max_drop(written: str) -> None:
    text = TINY_TEXT.replace(
        b"\ngate:\n", f"\ngate:\n  guard: {{set: general-mc-v1, max_drop: {written}}}\n".encode(), 1
    )
    with pytest.raises(SpecError) as err:
        parse_spec(text, Path("tiny-llama-lora.yaml"))
    [(where, says)] = err.value.problems
    assert where == "gate.guard.max_drop" and "write a number such as 0.05" in says, says


PARSE_WITH_OLD_TAG_LIMIT = r"""
import json, os, sys
from loraflow.spec import fields
fields.TAG_MAX_LEN = 1000  # the schema before tags were bounded: a 101-character tag passes validation
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=os.environ["DAGS"])
print(json.dumps({"dags": sorted(bag.dag_ids), "errors": dict(bag.import_errors)}))
"""


def test_a_spec_that_validates_but_cannot_build_is_its_own_import_error(tmp_path: Path) -> None:
    """The second depth: should the schema let through a value Airflow refuses, building that DAG fails
    for that spec alone, named in the import error; the other pipelines load and the broken DAG is not
    registered half-built."""
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "tiny-llama-lora.yaml").write_bytes(TINY_TEXT)
    (folder / "long-tag.yaml").write_text(yaml.safe_dump(tiny_with(TINY, "long-tag", {"tags": ["x" * 101]})))
    result = parse(folder, tmp_path, PARSE_WITH_OLD_TAG_LIMIT, LORAFLOW_SPEC_CACHE_DIR="off")
    assert result["dags"] == ["loraflow_registry", "tiny-llama-lora"]
    [message] = result["errors"].values()
    assert f"{folder / 'long-tag.yaml'}: its DAG cannot be built (ValueError: tag cannot be longer than 100" in message


def test_a_dag_whose_build_fails_after_its_tasks_exist_is_not_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DAG used as a context manager registers itself with its module when the block ends, even when
    the block raised: the pipeline's DAG must not reach the DagBag that way, half-built."""
    from airflow.sdk.definitions._internal.contextmanager import DagContext

    from loraflow.spec import cache as spec_cache
    from operators import dag_factory

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "tiny-llama-lora.yaml").write_bytes(TINY_TEXT)
    (folder / "odd.yaml").write_text(yaml.safe_dump(tiny_with(TINY, "odd", {})))
    real = dag_factory.attach_notifiers

    def attach_notifiers(spec: dict, dag: object) -> None:
        if spec["name"] == "odd":
            raise ValueError("a notifier cannot be attached")
        real(spec, dag)

    monkeypatch.setattr(dag_factory, "attach_notifiers", attach_notifiers)
    monkeypatch.setattr(dag_factory, "compiled", lambda path: spec_cache.compiled(path, cache_dir=tmp_path / "cache"))
    monkeypatch.setattr(DagContext, "current_autoregister_module_name", __name__)
    monkeypatch.setattr(DagContext, "autoregistered_dags", set())
    dags = dag_factory.load_pipelines(folder)
    assert sorted(dags) == ["_loraflow_invalid_specs", "tiny-llama-lora"]
    message = dags["_loraflow_invalid_specs"].doc_md or ""
    assert f"{folder / 'odd.yaml'}: its DAG cannot be built (ValueError: a notifier cannot be attached)" in message
    assert DagContext.autoregistered_dags == set()
