"""loraflow.data.dataset: reading, format detection, normalisation, and what it says about broken files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.data import dataset as ds
from loraflow.errors import DataValidationError

PC_ROWS = [{"prompt": "Is 12 even or odd?", "completion": "even"}, {"prompt": "Is 7 even or odd?", "completion": "odd"}]
CHAT_ROWS = [
    {
        "id": "a",
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Is 12 even or odd?"},
            {"role": "assistant", "content": "even"},
        ],
    },
    {
        "id": "b",
        "messages": [{"role": "user", "content": "Is 7 even or odd?"}, {"role": "assistant", "content": "odd"}],
    },
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return path


# ------------------------------------------------------------------------------------ good files


def test_prompt_completion_jsonl_normalises_to_user_and_assistant(tmp_path: Path) -> None:
    data = ds.load(write_jsonl(tmp_path / "d.jsonl", PC_ROWS), id_prefix="train-")
    assert data.format == ds.PROMPT_COMPLETION
    assert data.rows[0] == {
        "id": "train-000001",
        "messages": [{"role": "user", "content": "Is 12 even or odd?"}, {"role": "assistant", "content": "even"}],
    }
    assert data.lines == [1, 2]


def test_chat_jsonl_keeps_turns_and_ids(tmp_path: Path) -> None:
    data = ds.load(write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS))
    assert data.format == ds.CHAT
    assert [r["id"] for r in data.rows] == ["a", "b"]
    assert [m["role"] for m in data.rows[0]["messages"]] == ["system", "user", "assistant"]


def test_integer_ids_become_strings(tmp_path: Path) -> None:
    data = ds.load(write_jsonl(tmp_path / "d.jsonl", [{**PC_ROWS[0], "id": 7}]))
    assert data.rows[0]["id"] == "7"


def test_blank_lines_and_bom_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(PC_ROWS[0]).encode() + b"\n\n" + json.dumps(PC_ROWS[1]).encode())
    data = ds.load(path)
    assert len(data.rows) == 2 and data.lines == [1, 3]


@pytest.mark.parametrize("rows", [PC_ROWS, CHAT_ROWS], ids=["prompt_completion", "messages"])
def test_parquet_gives_the_same_rows_as_jsonl(tmp_path: Path, rows: list) -> None:
    from_jsonl = ds.load(write_jsonl(tmp_path / "d.jsonl", rows))
    from_parquet = ds.load(write_parquet(tmp_path / "d.parquet", rows))
    assert from_parquet.rows == from_jsonl.rows
    assert from_parquet.unit == "row"


def test_nulls_and_blanks_are_content_not_structure(tmp_path: Path) -> None:
    # The loader keeps them; the data-quality suite reports them (see test_validate_data).
    data = ds.load(write_jsonl(tmp_path / "d.jsonl", [{"prompt": None, "completion": ""}]))
    assert data.rows[0]["messages"] == [{"role": "user", "content": None}, {"role": "assistant", "content": ""}]


def test_prompt_and_reference_splits_at_the_last_assistant_turn() -> None:
    prompt, answer = ds.prompt_and_reference(CHAT_ROWS[0]["messages"])
    assert [m["role"] for m in prompt] == ["system", "user"] and answer == "even"


def test_find_dataset_file(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", PC_ROWS)
    (tmp_path / "_MANIFEST.json").write_text("{}")
    assert ds.find_dataset_file(tmp_path).name == "train.jsonl"
    write_jsonl(tmp_path / "more.jsonl", PC_ROWS)
    with pytest.raises(DataValidationError, match="2 dataset files found"):
        ds.find_dataset_file(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataValidationError, match="no dataset file found"):
        ds.find_dataset_file(empty)


# ------------------------------------------------------------------------- the malformed corpus

GOOD = json.dumps(PC_ROWS[0])

# name -> (file name, raw bytes, fragments the message must hold)
MALFORMED: dict[str, tuple[str, bytes, list[str]]] = {
    "invalid_json_line": (
        "d.jsonl",
        f'{GOOD}\n{GOOD}\n{{"prompt": "Is 3 even", "completion": }}\n'.encode(),
        ["line 3", "invalid JSON", "one complete JSON object"],
    ),
    "truncated_last_line": ("d.jsonl", f'{GOOD}\n{{"prompt": "Is 3'.encode(), ["line 2", "invalid JSON"]),
    "missing_completion_column": (
        "d.jsonl",
        f'{GOOD}\n{{"prompt": "Is 3 even or odd?"}}\n'.encode(),
        ["line 2", "missing column 'completion'"],
    ),
    "no_known_columns": (
        "d.jsonl",
        b'{"question": "Is 3 even or odd?", "answer": "odd"}\n',
        ["line 1", "needs 'prompt' and 'completion', or 'messages'", "answer, question"],
    ),
    "wrong_role": (
        "d.jsonl",
        b'{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n',
        ["line 1", "messages[0]", "invalid role 'human'", "system, user, assistant"],
    ),
    "turn_without_content": (
        "d.jsonl",
        b'{"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}\n',
        ["line 1", "messages[0] must be an object with 'role' and 'content'"],
    ),
    "messages_not_a_list": ("d.jsonl", b'{"messages": "hello"}\n', ["line 1", "'messages' must be a non-empty list"]),
    "empty_file": ("d.jsonl", b"", ["holds no examples"]),
    "only_blank_lines": ("d.jsonl", b"\n  \n\n", ["holds no examples"]),
    "bad_encoding": (
        "d.jsonl",
        GOOD.encode() + b"\n" + '{"prompt": "caf\u00e9", "completion": "x"}'.encode("latin-1") + b"\n",
        ["line 2", "not valid UTF-8", "byte 0xe9", "save the file as UTF-8"],
    ),
    "mixed_formats": (
        "d.jsonl",
        (GOOD + "\n") * 3 + json.dumps(CHAT_ROWS[1]).encode().decode() + "\n",
        ["mixed formats", "line 4 use messages", "3 line(s) use prompt/completion", "one format per file"],
    ),
    "both_formats_in_one_row": (
        "d.jsonl",
        json.dumps({**PC_ROWS[0], "messages": CHAT_ROWS[1]["messages"]}).encode(),
        ["line 1", "both 'messages' and 'prompt'/'completion'"],
    ),
    "not_an_object": ("d.jsonl", b'["Is 3 even or odd?", "odd"]\n', ["line 1", "is a JSON list, not an object"]),
    "number_as_completion": (
        "d.jsonl",
        b'{"prompt": "What is 2+2?", "completion": 4}\n',
        ["line 1", "'completion' must be a string, got int", "quote it"],
    ),
    "bad_id": (
        "d.jsonl",
        b'{"id": [1], "prompt": "a", "completion": "b"}\n',
        ["line 1", "'id' must be a string or an integer"],
    ),
    "unknown_extension": ("d.csv", b"prompt,completion\na,b\n", ["unknown file type '.csv'", ".jsonl", ".parquet"]),
    "corrupt_parquet": ("d.parquet", b"PAR1 this is not parquet", ["cannot be read as Parquet"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_dataset_names_file_line_and_fix(tmp_path: Path, case: str) -> None:
    name, raw, fragments = MALFORMED[case]
    path = tmp_path / name
    path.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    with pytest.raises(ds.DatasetError) as info:
        ds.load(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_every_problem_is_reported_not_just_the_first(tmp_path: Path) -> None:
    lines = [GOOD, "{broken", '{"prompt": "x"}', GOOD, '{"messages": [{"role": "bot", "content": "x"}]}']
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ds.DatasetError) as info:
        ds.load(path)
    err = info.value
    assert {p.line for p in err.problems if p.line} == {2, 3, 5}
    assert "4 problem(s)" in str(err)  # the three lines, and mixed formats (line 5 is chat)


def test_problems_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("{bad\n" * 50)
    with pytest.raises(ds.DatasetError) as info:
        ds.load(path)
    assert len(info.value.problems) == ds.MAX_PROBLEMS
    assert "50 problem(s)" in str(info.value) and "and 30 more" in str(info.value)


def test_parquet_problems_name_the_row(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 2
    rows.append({"messages": [{"role": "robot", "content": "a"}]})
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(ds.DatasetError, match=r"row 3: messages\[0\] has invalid role 'robot'"):
        ds.load(path)
