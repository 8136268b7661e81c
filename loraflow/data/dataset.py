"""Reading a fine-tuning dataset file and normalising it to chat messages.

Two input formats, one per file, detected from each row's keys:

* prompt/completion: ``{"prompt": "...", "completion": "..."}`` -> a user turn and an assistant turn;
* chat: ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (roles system, user, assistant).

Files are JSON Lines (``.jsonl``, ``.ndjson``) or Parquet (``.parquet``, ``.pq``), chosen by
extension. An optional ``id`` field (string or integer) is kept; otherwise a row is called
``{id_prefix}{line:06d}``. Every row normalises to::

    {"id": "...", "messages": [{"role": "...", "content": "..."}, ...]}

The loader checks *structure* (the file decodes, every line is a JSON object, the columns and
roles are the ones above, values have the right types) and reports every problem it finds, up to
``MAX_PROBLEMS``, each naming the file, the line (row, for Parquet) and what to fix. It does not
judge *content*: a null or blank text is kept as is (``None``/``""``) so that the data-quality
suite (steps/validate_data) can report it together with token lengths, duplicates and the rest.

Pure library code: no I/O beyond reading the one file; pandas/pyarrow are imported inside functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.errors import DataValidationError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
ROLES = ("system", "user", "assistant")
MAX_PROBLEMS = 20

PROMPT_COMPLETION = "prompt_completion"
CHAT = "messages"


@dataclass(frozen=True)
class Problem:
    line: int | None  # 1-based line (JSONL) or row (Parquet); None for the file as a whole
    message: str


class DatasetError(DataValidationError):
    """A dataset file breaks the format contract; ``problems`` lists every one found (up to a cap)."""

    def __init__(self, path: Path | str, problems: Sequence[Problem], total: int | None = None, unit: str = "line"):
        self.path = str(path)
        self.problems = list(problems)
        total = len(self.problems) if total is None else total
        lines = [f"{self.path}: {total} problem(s) in the dataset file"]
        for p in self.problems:
            where = f"{unit} {p.line}: " if p.line is not None else ""
            lines.append(f"  - {where}{p.message}")
        if total > len(self.problems):
            lines.append(f"  ... and {total - len(self.problems)} more (fix these first)")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Dataset:
    path: Path
    format: str  # PROMPT_COMPLETION or CHAT
    rows: list[dict[str, Any]]  # normalised: {"id", "messages"}
    lines: list[int]  # the 1-based source line (row) of each normalised row
    unit: str  # "line" (JSONL) or "row" (Parquet)


class _Collector:
    def __init__(self, cap: int = MAX_PROBLEMS):
        self.cap = cap
        self.problems: list[Problem] = []
        self.total = 0

    def add(self, line: int | None, message: str) -> None:
        self.total += 1
        if len(self.problems) < self.cap:
            self.problems.append(Problem(line, message))

    def raise_if_any(self, path: Path, unit: str) -> None:
        if self.total:
            raise DatasetError(path, self.problems, self.total, unit)


# ------------------------------------------------------------------------------------- locating


def find_dataset_file(directory: Path) -> Path:
    """The one dataset file in ``directory`` (or ``directory`` itself if it is a file)."""
    if directory.is_file():
        return directory
    candidates = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith((".", "_")))
    supported = [p for p in candidates if p.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES]
    if len(supported) == 1:
        return supported[0]
    names = ", ".join(p.relative_to(directory).as_posix() for p in candidates) or "nothing"
    if not supported:
        raise DataValidationError(
            f"{directory}: no dataset file found (it holds {names}); "
            f"give one file ending in {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    raise DataValidationError(
        f"{directory}: {len(supported)} dataset files found ({names}); give exactly one file per dataset"
    )


# -------------------------------------------------------------------------------------- reading


def read_records(path: Path, problems: _Collector | None = None) -> tuple[list[tuple[int, Any]], str]:
    """``[(line, record), ...]`` and the unit ("line"/"row"); raises DatasetError on unreadable input."""
    path = Path(path)
    own = problems is None
    problems = problems or _Collector()
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        records, unit = list(_read_jsonl(path, problems)), "line"
    elif suffix in PARQUET_SUFFIXES:
        records, unit = _read_parquet(path, problems), "row"
    else:
        raise DatasetError(
            path,
            [Problem(None, f"unknown file type {suffix or '(none)'!r}; use .jsonl (JSON Lines) or .parquet")],
        )
    if not records and not problems.total:
        problems.add(None, "the file holds no examples (it is empty or only blank lines); give at least one row")
    if own:
        problems.raise_if_any(path, unit)
    return records, unit


def _read_jsonl(path: Path, problems: _Collector) -> Iterator[tuple[int, Any]]:
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark: harmless, drop it
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.add(
                number,
                f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); save the file as UTF-8",
            )
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.add(
                number,
                f"invalid JSON ({exc.msg} at column {exc.colno}); each line must be one complete JSON object",
            )
            continue
        yield number, record


def _read_parquet(path: Path, problems: _Collector) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged or foreign file
        problems.add(None, f"cannot be read as Parquet ({exc}); write it with pandas.DataFrame.to_parquet or pyarrow")
        return []
    return [(i, rec) for i, rec in enumerate(table.to_pylist(), start=1)]


# ---------------------------------------------------------------------------------- normalising


def _row_format(record: dict[str, Any]) -> str | None:
    has_chat = "messages" in record and record["messages"] is not None
    has_pc = "prompt" in record or "completion" in record
    if has_chat and not has_pc:
        return CHAT
    if has_pc and not has_chat:
        return PROMPT_COMPLETION
    return None


def _text(value: Any, what: str, problems: _Collector, line: int) -> str | None:
    if value is None or isinstance(value, str):
        return value
    problems.add(line, f"{what} must be a string, got {type(value).__name__} {value!r:.40}; quote it as text")
    return None


def _fmt_lines(lines: Sequence[int], unit: str, limit: int = 5) -> str:
    shown = ", ".join(str(n) for n in lines[:limit])
    more = f" and {len(lines) - limit} more" if len(lines) > limit else ""
    return f"{unit}{'s' if len(lines) > 1 else ''} {shown}{more}"


def normalise(
    records: Sequence[tuple[int, Any]],
    path: Path | str,
    unit: str = "line",
    id_prefix: str = "",
    problems: _Collector | None = None,
) -> Dataset:
    """Detect the format and normalise every record; raise DatasetError listing every problem.

    ``problems`` may already hold what reading found (lines that did not parse): they are
    reported together with the records' own problems, sorted by line.
    """
    path = Path(path)
    problems = problems or _Collector()
    formats: dict[str, list[int]] = {PROMPT_COMPLETION: [], CHAT: []}
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for line, record in records:
        fmt = _record_format(record, line, problems)
        if fmt is None:
            continue
        formats[fmt].append(line)
        row = _normalise_record(record, fmt, line, id_prefix, problems)
        if row is not None:
            rows.append(row)
            lines.append(line)
    mixed = _mixed_formats(formats, unit)
    if mixed is not None:
        problems.add(None, mixed)
    if not records and not problems.total:
        problems.add(None, "the file holds no examples; give at least one row")
    problems.problems.sort(key=lambda p: (p.line is not None, p.line or 0))
    problems.raise_if_any(path, unit)
    fmt = CHAT if formats[CHAT] else PROMPT_COMPLETION
    return Dataset(path, fmt, rows, lines, unit)


def _record_format(record: Any, line: int, problems: _Collector) -> str | None:
    """The record's format; None, with the problem noted, when it is not an object of one known format."""
    if not isinstance(record, dict):
        problems.add(
            line, f'is a JSON {type(record).__name__}, not an object; write {{"prompt": ..., "completion": ...}}'
        )
        return None
    fmt = _row_format(record)
    if fmt is None:
        keys = ", ".join(sorted(map(str, record))) or "none"
        if "messages" in record and record["messages"] is not None:
            problems.add(line, f"has both 'messages' and 'prompt'/'completion' (keys: {keys}); keep one format")
        else:
            problems.add(
                line,
                f"missing columns: needs 'prompt' and 'completion', or 'messages' (found keys: {keys})",
            )
    return fmt


def _normalise_record(
    record: dict[str, Any], fmt: str, line: int, id_prefix: str, problems: _Collector
) -> dict[str, Any] | None:
    """The row ``{"id", "messages"}`` of a record in format ``fmt``; None when it has problems (noted)."""
    before = problems.total
    messages = (
        _pc_messages(record, line, problems) if fmt == PROMPT_COMPLETION else _chat_messages(record, line, problems)
    )
    row_id = _row_id(record, line, id_prefix, problems)
    if problems.total != before:
        return None
    return {"id": row_id, "messages": messages}


def _mixed_formats(formats: dict[str, list[int]], unit: str) -> str | None:
    """The problem of a file whose rows use both formats (naming the minority's rows); None if it uses one."""
    if not (formats[PROMPT_COMPLETION] and formats[CHAT]):
        return None
    minority = min(formats.values(), key=len)
    other = PROMPT_COMPLETION if minority is formats[CHAT] else CHAT
    name = {PROMPT_COMPLETION: "prompt/completion", CHAT: "messages"}
    this = CHAT if other == PROMPT_COMPLETION else PROMPT_COMPLETION
    return (
        f"mixed formats: {_fmt_lines(minority, unit)} use {name[this]} while "
        f"{len(formats[other])} {unit}(s) use {name[other]}; use one format per file"
    )


def _pc_messages(record: dict[str, Any], line: int, problems: _Collector) -> list[dict[str, Any]]:
    missing = [k for k in ("prompt", "completion") if k not in record]
    if missing:
        problems.add(
            line, f"missing column {' and '.join(repr(k) for k in missing)}; every row needs 'prompt' and 'completion'"
        )
        return []
    prompt = _text(record["prompt"], "'prompt'", problems, line)
    completion = _text(record["completion"], "'completion'", problems, line)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def _chat_messages(record: dict[str, Any], line: int, problems: _Collector) -> list[dict[str, Any]]:
    turns = record["messages"]
    if not isinstance(turns, list) or not turns:
        problems.add(line, '\'messages\' must be a non-empty list of {"role": ..., "content": ...} objects')
        return []
    out: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            problems.add(line, f"{where} must be an object with 'role' and 'content' (got {turn!r:.60})")
            continue
        role = turn["role"]
        if role not in ROLES:
            problems.add(line, f"{where} has invalid role {role!r}; use one of {', '.join(ROLES)}")
            continue
        out.append({"role": role, "content": _text(turn["content"], f"{where}.content", problems, line)})
    return out


def _row_id(record: dict[str, Any], line: int, id_prefix: str, problems: _Collector) -> str:
    value = record.get("id")
    if value is None:
        return f"{id_prefix}{line:06d}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        problems.add(line, f"'id' must be a string or an integer, got {type(value).__name__}; or drop the column")
        return ""
    return str(value)


def load(path: Path | str, id_prefix: str = "") -> Dataset:
    """Read, detect and normalise one dataset file; raises DatasetError listing every problem."""
    path = Path(path)
    problems = _Collector()
    records, unit = read_records(path, problems)
    return normalise(records, path, unit, id_prefix, problems)


# ------------------------------------------------------------------------------------ rendering


def prompt_and_reference(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
    """Split a conversation into the prompt turns and the answer: the last assistant turn.

    For single-turn data the prompt is the user turn; for longer chats it is every turn before
    the final assistant turn (system and earlier turns are context the model must see).
    """
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return list(messages[:i]), messages[i]["content"]
    return list(messages), None


def write_jsonl(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
