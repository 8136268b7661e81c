"""The registry listing (``loraflow registry list``, the maintenance DAG's list) over objects a bucket
writer made: what is malformed is named with its object and the repair, never fatal, and every field
read from storage is printed on its own line's terms (a line break or an escape code cannot forge a row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.errors import ArtifactError
from loraflow.registry import audit, operations, store
from loraflow.storage import artifacts, gcs
from operators.registry import RegistryOperator

from .champions import register_champion
from .test_daily_cli import run
from .test_registry_dag import context, spec_folder
from .test_registry_operations import PIPELINE, three_versions


@pytest.fixture
def reg(gcs_bucket: str, tmp_path: Path) -> operations.PipelineRegistry:
    return three_versions(gcs_bucket, tmp_path)


def rewrite(uri: str, change: dict[str, object], drop: tuple[str, ...] = ()) -> None:
    """What a bucket writer does: the object at ``uri`` with ``change`` applied and ``drop`` removed."""
    data = {**artifacts.read_json(uri), **change}  # type: ignore[dict-item]
    artifacts.write_json(uri, {k: v for k, v in data.items() if k not in drop})


def version(reg: operations.PipelineRegistry, number: int) -> str:
    return store.version_uri(reg.registry_uri, PIPELINE, number)


def test_a_malformed_version_is_listed_with_what_is_readable_and_named(reg: operations.PipelineRegistry) -> None:
    rewrite(version(reg, 2), {"metrics": ["accuracy", 0.99], "created_at": {"at": 1}})
    rewrite(version(reg, 1), {"metrics": {"accuracy": {"x": 1}, "f1": [0.5], "n": 100}})
    rewrite(version(reg, 3), {"metrics": "0.8"})
    listed = operations.listing(reg)
    v1, v2, v3 = listed["versions"]
    assert v2["run_id"] == "run-2" and v2["metrics"] == {} and "created_at" not in v2
    assert v2["problem"].startswith(f"{version(reg, 2)} is not a version as publish writes it: ")
    assert "its created_at is {'at': 1}, not text; its metrics is ['accuracy', 0.99], not an object" in v2["problem"]
    assert "restore the object from the bucket's object history" in v2["problem"]
    assert v1["metrics"] == {"n": 100} and 'its metrics "accuracy", "f1" are not figures' in v1["problem"]
    assert v1["eval_set"] == "eval-fp" and v1["gate_manifest"].endswith("/run-1/gate/_MANIFEST.json")
    assert v3["metrics"] == {} and 'its metrics is "0.8", not an object of names and figures' in v3["problem"]
    text = operations.render(listed)
    assert "run-2" in text and f"problem: {version(reg, 2)} is not a version" in text
    assert "accuracy=0.6" not in text and "n=100" in text and "champion: version 3" in text
    json.dumps(listed)  # --json prints it too


def test_a_version_of_an_older_format_is_read_up_to_the_versions_cap(reg: operations.PipelineRegistry) -> None:
    """Versions registered before publish kept scalars only embedded per-example lists (hundreds of kB)."""
    rewrite(version(reg, 1), {"decision": {"tuned_metrics": {"correct": [1] * 100_000}}})
    [v1] = [v for v in operations.listing(reg)["versions"] if v["version"] == 1]
    assert "problem" not in v1 and v1["run_id"] == "run-1"


def test_a_version_that_is_no_json_object_is_listed_unreadable(reg: operations.PipelineRegistry) -> None:
    bucket, name = gcs.split_uri(version(reg, 2))
    gcs.client().bucket(bucket).blob(name).upload_from_string(b"[1, 2]")
    text = operations.render(operations.listing(reg))
    assert f"        2  (unreadable: {version(reg, 2)} is not a JSON object" in text
    assert "run-1" in text and "run-3" in text


def test_an_audit_event_without_its_time_is_named_and_the_trail_goes_on(reg: operations.PipelineRegistry) -> None:
    operations.rollback(reg, actor="a", reason="r1", via="cli")  # #1: 3 -> 2
    operations.rollback(reg, actor="b", reason="r2", via="cli")  # #2: 2 -> 1
    first = audit.event_uri(reg.registry_uri, PIPELINE, 1)
    rewrite(first, {}, drop=("at",))
    listed = operations.listing(reg)
    broken, kept = listed["audit"]
    assert broken["problem"] == (
        f"{first} is not an event of this trail: it has no at; an event is written once and never rewritten: "
        "restore the object from the bucket's object history (until then a rollback does not count it)"
    )
    assert kept["actor"] == "b"
    text = operations.render(listed)
    assert f"#1    (unreadable: {first} is not an event" in text and "rollback v2 -> v1  by b (cli)" in text
    # until it is restored, the rollback it recorded does not withdraw version 3
    assert [v["withdrawn"] for v in listed["versions"]] == [False, True, False]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"actor": ["x"]}, "its actor is ['x'], not text"),
        ({"via": None}, "its via is None, not text"),
        ({"reason": 3}, "its reason is 3, not text"),
        ({"to_version": "2"}, 'its to_version is "2", not a number'),
        ({"from_version": True}, "its from_version is True, not a number"),
        ({"action": "delete"}, 'its action is "delete", not one of publish, promote, rollback'),
        ({"format": "x/2"}, f'its format is "x/2", not {audit.FORMAT}'),
    ],
)
def test_each_field_of_an_event_is_checked(reg: operations.PipelineRegistry, change: dict, problem: str) -> None:
    operations.rollback(reg, actor="a", reason="r1", via="cli")
    rewrite(audit.event_uri(reg.registry_uri, PIPELINE, 1), change)
    [event] = operations.listing(reg)["audit"]
    assert f"is not an event of this trail: {problem};" in event["problem"]


def test_an_alias_that_is_not_one_is_named_and_the_versions_are_listed(reg: operations.PipelineRegistry) -> None:
    where = store.alias_uri(reg.registry_uri, PIPELINE)
    rewrite(where, {"version": "3"})
    listed = operations.listing(reg)
    assert listed["champion"] is None and [v["version"] for v in listed["versions"]] == [1, 2, 3]
    assert listed["alias_uri"] == where
    assert listed["alias_problem"].startswith(f"the champion alias {where} is refused: its version is '3'")
    text = operations.render(listed)
    assert "; champion: unreadable: the champion alias" in text and "delete it" in text
    with pytest.raises(ArtifactError, match=r"its version is '3'"):
        operations.rollback(reg, actor="a", reason="r", via="cli")  # a move still refuses it


def test_the_cli_and_the_dag_list_a_registry_with_malformed_objects(
    gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = spec_folder(tmp_path, gcs_bucket)
    root, registry_uri, name = f"{gcs_bucket}/artifacts", f"{gcs_bucket}/artifacts/_registry", "tiny-llama-lora"
    for n in (1, 2):
        register_champion(registry_uri, root, tmp_path, pipeline=name, run=f"run-{n}", version=n)
    operations.rollback(operations.PipelineRegistry(registry_uri, name, root), actor="a", reason="r", via="cli")
    rewrite(store.version_uri(registry_uri, name, 2), {"metrics": [1], "created_at": {"a": 1}})
    rewrite(audit.event_uri(registry_uri, name, 1), {}, drop=("at",))
    rc, out, err = run(capsys, "registry", "list", name, "--pipelines", str(folder))
    assert rc == 0 and err == "" and "its metrics is [1]" in out and "it has no at" in out
    listed = RegistryOperator(task_id="registry", pipelines_dir=str(folder)).execute(
        context({"action": "list", "pipeline": name, "version": None, "reason": ""})  # type: ignore[arg-type]
    )
    assert listed["champion"] == 1 and listed["versions"] == [1, 2]


# ------------------------------------------------------------------------ fields printed from storage


@pytest.mark.parametrize(
    ("value", "printed", "quoted"),
    [
        ("run-2", "run-2", '"run-2"'),
        ("été 2026", "été 2026", '"été 2026"'),
        ("a\nb", '"a\\nb"', '"a\\nb"'),
        ("RUN-X", "RUN-X", '"RUN-X"'),  # mutmut pads character sets with X
        ("\x1b[2J\x9b\u202e\u2028", '"\\x1b[2J\\x9b\\u202e\\u2028"', '"\\x1b[2J\\x9b\\u202e\\u2028"'),
        ("C:\\n", '"C:\\\\n"', '"C:\\\\n"'),  # a backslash is escaped: it can never pass for an escape
        ('say "hi"', 'say "hi"', '"say \\"hi\\""'),
        ('say "hi"\n', '"say \\"hi\\"\\n"', '"say \\"hi\\"\\n"'),
        (None, "None", "None"),
        ({"a": "\x1b"}, "{'a': '\\x1b'}", "{'a': '\\x1b'}"),
        (3, "3", "3"),
    ],
)
def test_a_stored_field_is_printed_as_text_or_quoted_and_escaped(value: object, printed: str, quoted: str) -> None:
    assert store.shown(value) == printed and store.shown(value, quoted=True) == quoted


def test_a_huge_stored_field_is_cut() -> None:
    text = store.shown("x" * 5000)
    assert len(text) == store.SHOWN_MAX_CHARS and text.endswith("x...")
    assert store.shown("x" * store.SHOWN_MAX_CHARS) == "x" * store.SHOWN_MAX_CHARS


def test_no_field_from_storage_can_break_a_line_or_reach_the_terminal_raw(reg: operations.PipelineRegistry) -> None:
    operations.rollback(reg, actor="a", reason="r", via="cli")  # 3 -> 2
    forged_row = "run-2\n*       9  2026-12-06T00:00:00Z  run-9"
    rewrite(version(reg, 2), {"run_id": forged_row, "created_at": "\x1b[2J\x1b[H", "model_manifest": "gs://b/\u202em"})
    rewrite(
        audit.event_uri(reg.registry_uri, PIPELINE, 1),
        {
            "actor": "eve\n  #2    2026-12-06T00:00:00Z  promote  v2 -> v9",
            "via": "cli\r",
            "at": "\x9b2J",
            "reason": "\u2028",
        },
    )
    text = operations.render(operations.listing(reg))
    lines = text.splitlines()
    assert len(lines) == len(text.split("\n")) == 14  # header, columns, 3 x 3 version lines, legend, trail, 1 event
    assert [ln[:9] for ln in lines if ln.startswith("*")] == ["*       2", "* champio"]  # no forged champion row
    assert all(ch == "\n" or ch.isprintable() for ch in text)  # no escape code, bidi override or separator
    assert '"run-2\\n*       9  2026-12-06T00:00:00Z  run-9"' in text and '"\\x1b[2J\\x1b[H"' in text
    assert '"gs://b/\\u202em"' in text
    assert 'by "eve\\n  #2    2026-12-06T00:00:00Z  promote  v2 -> v9" ("cli\\r"): "\\u2028"' in text
    assert lines[-1].startswith('  #1    "\\x9b2J"  rollback v3 -> v2')


def test_a_move_by_an_actor_with_a_line_break_is_summarised_on_one_line(reg: operations.PipelineRegistry) -> None:
    done = operations.rollback(reg, actor="bob\n#9 forged", reason="why\x1b[31m", via="cli")
    line = operations.summary_line(done)
    assert "\n" not in line and "\x1b" not in line
    assert line.endswith('by "bob\\n#9 forged" (cli): "why\\x1b[31m"')


def test_a_refused_concurrent_move_quotes_who_moved_the_alias(
    reg: operations.PipelineRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = operations._verified

    def verified_while_mallory_rolls_back(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(operations, "_verified", real)
        operations.rollback(reg, actor="mallory\x1b]0;owned\x07", reason="r", via="cli")
        return real(*args, **kwargs)

    monkeypatch.setattr(operations, "_verified", verified_while_mallory_rolls_back)
    with pytest.raises(operations.ConcurrentMove) as refused:
        operations.promote(reg, 1, actor="alice", reason="r", via="cli")
    assert 'moved by "mallory\\x1b]0;owned\\x07" at ' in str(refused.value) and "\x1b" not in str(refused.value)


def test_the_listing_renders_as_documented() -> None:
    """render() is a pure function of the listing: every column, mark and line pinned."""
    event = {
        "format": audit.FORMAT, "sequence": 1, "action": "rollback", "from_version": 3, "to_version": 2,
        "actor": "alice", "reason": "v3 is worse", "via": "cli", "at": "2026-12-06T09:10:07Z",
    }  # fmt: skip
    listed = {
        "pipeline": "tiny",
        "registry": "gs://b/_registry",
        "champion": 2,
        "versions": [
            {"version": 1, "champion": False, "withdrawn": False, "problem": "gs://b/1.json is not a JSON object"},
            {
                "version": 2,
                "champion": True,
                "withdrawn": False,
                "run_id": "run-2",
                "created_at": "2026-12-05T16:41:02Z",
                "metrics": {"n": 400, "accuracy": 0.93751, "note": "ok"},
                "model_manifest": "gs://b/m2",
                "gate_manifest": "gs://b/g2",
            },
            {"version": 3, "champion": False, "withdrawn": True, "metrics": {}, "problem": "its run_id is 3"},
        ],
        "audit": [
            event,
            {**event, "sequence": 2, "action": "promote", "from_version": None, "to_version": 3, "pending": True},
            {"sequence": 3, "uri": "gs://b/000003.json", "problem": "gs://b/000003.json is not an event"},
        ],
    }
    assert operations.render(listed).split("\n") == [
        "registry of tiny (gs://b/_registry); champion: version 2",
        "  version  created               run                                       metrics",
        "        1  (unreadable: gs://b/1.json is not a JSON object)",
        "*       2  2026-12-05T16:41:02Z  run-2                                     accuracy=0.9375, n=400, note=ok",
        "           model gs://b/m2",
        "           gate  gs://b/g2",
        "x       3  ?                     ?                                         ",
        "           model ?",
        "           gate  ?",
        "           problem: its run_id is 3",
        "* champion   x withdrawn by a rollback",
        "audit trail:",
        '  #1    2026-12-06T09:10:07Z  rollback v3 -> v2  by alice (cli): "v3 is worse"',
        '  #2    2026-12-06T09:10:07Z  promote  (none) -> v3  by alice (cli): "v3 is worse"  '
        "[event not yet written; from the alias]",
        "  #3    (unreadable: gs://b/000003.json is not an event)",
    ]
    empty = {**listed, "champion": None, "versions": [], "audit": []}
    assert operations.render(empty).split("\n") == [
        "registry of tiny (gs://b/_registry); champion: none yet",
        "  version  created               run                                       metrics",
        "  (no versions: no run of this pipeline was promoted yet)",
        "* champion   x withdrawn by a rollback",
        "audit trail: (empty)",
    ]


def test_a_concurrent_move_by_a_writer_that_records_no_event_is_refused_without_a_name(
    reg: operations.PipelineRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = operations._verified

    def verified_while_an_old_publish_moves_the_alias(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(operations, "_verified", real)
        artifacts.write_json(store.alias_uri(reg.registry_uri, PIPELINE), {"version": 2})  # no move recorded
        return real(*args, **kwargs)

    monkeypatch.setattr(operations, "_verified", verified_while_an_old_publish_moves_the_alias)
    with pytest.raises(operations.ConcurrentMove, match=r"it held version 3, now 2\); nothing was changed"):
        operations.promote(reg, 1, actor="alice", reason="r", via="cli")
