"""Step program for the validate_data stage: the dataset's contract, checked before any TPU time.

Inputs (local directories, fetched by the harness):
    train       one dataset file (JSONL or Parquet; prompt/completion or chat messages)
    eval        one dataset file, same formats
    tokenizer   an HF checkpoint directory holding tokenizer.json (+ tokenizer_config.json)

Config (``loraflow.spec.step_configs.ValidateDataConfig``)::

    expectations: {RULE: {level: fail|warn, ...thresholds}}   the spec's data.expectations
                                                               (loraflow.spec.expectations; all optional)
    chat_template: auto | tokenizer | tokenizer:NAME | none | inline Jinja   the spec's data.chat_template

Two layers of checks. First the loader (loraflow.data.dataset) checks structure: the file decodes,
each line is a JSON object, the columns and roles are known; it reports every problem with its
line, and an unreadable dataset always fails. Then a Great Expectations suite per dataset checks
the spec's rules on a flat frame with one row per example: format (last turn an assistant answer,
required roles present), no null and no blank prompt/completion, token length within bounds,
unique ids, duplicate and near-empty examples, enough rows and, for eval, no prompt that also
appears in train (leakage). Each expectation belongs to one rule and takes its level: a
``fail`` rule that breaks stops the stage with one DataValidationError naming every failed rule
and its fix; a ``warn`` rule that breaks is logged, listed in data_report.json (``warnings``)
and in the manifest summary, and the data is accepted.

The chat template (config ``chat_template``, the spec's ``data.chat_template``) is resolved here
against the tokenizer input (``loraflow.data.chat_template``) and every row is rendered through it
as training will render it; a row it refuses (a failed render, a generation prompt that does not
begin the answer's turn, history rewritten once later turns follow) fails the stage naming the row.
Token length = number of tokens of that text (special tokens included), encoded with
``add_special_tokens=False`` since the template writes them itself.

Outputs: train.jsonl ({"id", "messages"}), eval.jsonl ({"id", "messages": the prompt turns,
"reference": the answer}), chat_template.json (the resolved template: training and both
evaluations render with it), data_report.json (every expectation's rule, level, observed value and
outcome, and statistics) and data_docs/ (Great Expectations' HTML data docs of both suites, built
by GX's own renderer from results whose dataset strings are HTML-escaped first, so an id or prompt
holding markup reads as text and never runs: ``escape_stored_results``; data_docs/index.html is the
page the Airflow task links). On a fail-level failure only data_report.json and data_docs/ are
written and DataValidationError lists every failed rule in plain words; the harness keeps them
under ``<output>/_rejected/`` and commits nothing, so a rejected dataset can never be an input of a
later stage.
"""

from __future__ import annotations

import functools
import html
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.data import chat_template
from loraflow.data import dataset as ds
from loraflow.errors import DataValidationError, LoraflowError
from loraflow.spec import expectations as contract
from loraflow.spec.stages import DATA_REPORT
from loraflow.spec.step_configs import ValidateDataConfig, parse
from loraflow.steps._harness import StepContext, import_permanently, run_and_exit

STAGE = "validate_data"
SPLITS = ("train", "eval")
EXAMPLES_IN_REPORT = 5
ROWS_IN_MESSAGE = 5
DATA_DOCS = "data_docs"
_DOCS_SITE = "loraflow"


def resolve_config(raw: dict[str, Any]) -> contract.DataExpectations:
    """The rules from the stage config (``{"expectations": {...}}``), every problem at once."""
    moved = sorted(k for k in raw if k in contract.MOVED)
    if moved:
        raise LoraflowError(f"{STAGE}: unknown config key(s) {', '.join(moved)} ({contract.moved_keys_message(moved)})")
    return parse(ValidateDataConfig, raw).expectations


# ------------------------------------------------------------------------------- token counting


class TokenCounter:
    """Counts tokens of a conversation as the trainer will see it (see the module docstring)."""

    def __init__(self, checkpoint_dir: Path, setting: str = chat_template.AUTO):
        from tokenizers import Tokenizer

        found = sorted(checkpoint_dir.rglob("tokenizer.json"))
        if not found:
            raise LoraflowError(
                f"{STAGE}: no tokenizer.json under the tokenizer input ({checkpoint_dir}); "
                "point it at an HF checkpoint with a fast tokenizer"
            )
        self.tokenizer = Tokenizer.from_file(str(found[0]))
        try:
            self.template = chat_template.resolve(setting, found[0].parent)
        except chat_template.ChatTemplateError as exc:
            raise DataValidationError(f"{STAGE}: data.chat_template: {exc}") from None
        self.method = f"chat_template: {self.template.origin}, add_special_tokens=False"
        # (split, line, message) of every row the template cannot render as training renders it
        self.refused: list[tuple[str, int, str]] = []

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        """The conversation's training text: its prompt and answer pieces, joined."""
        return "".join(text for text, _ in chat_template.pieces(self.template, messages))

    def count(self, data: ds.Dataset, split: str) -> list[int]:
        texts = []
        for line, row in zip(data.lines, data.rows, strict=True):
            try:
                texts.append(self.render(row["messages"]))
            except chat_template.TemplateBoundError as exc:  # it would fail (slowly) on every row: stop here
                raise DataValidationError(
                    f"{STAGE}: data.chat_template ({self.template.origin}) at {split} {data.unit} {line}: {exc}"
                ) from None
            except chat_template.ChatTemplateError as exc:
                # A row without an answer is the format rule's finding; anything else the template's.
                if any(m["role"] == "assistant" for m in row["messages"]):
                    self.refused.append((split, line, str(exc)))
                texts.append("")
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def raise_if_refused(self, loaded: dict[str, ds.Dataset]) -> None:
        """One DataValidationError naming the rows the template refused (the first few) and the fix."""
        if not self.refused:
            return
        shown = [f"{split} {loaded[split].unit} {line}: {message}" for split, line, message in self.refused]
        more = len(shown) - ROWS_IN_MESSAGE
        raise DataValidationError(
            f"{STAGE}: the chat template ({self.template.origin}) cannot render {len(shown)} row(s) as training "
            "and evaluation need them:\n  - "
            + "\n  - ".join(shown[:ROWS_IN_MESSAGE])
            + (f"\n  ... and {more} more" if more > 0 else "")
            + "\nFix the rows or set data.chat_template to a template that renders them (docs/data.md)"
        )


# ----------------------------------------------------------------------------------- the frames


def _joined(contents: Sequence[Any]) -> str | None:
    """Text of several turns: None if any is null, "" if any is blank (so either is reported)."""
    if not contents or any(c is None for c in contents):
        return None
    if any(not c.strip() for c in contents):
        return ""
    return "\n".join(contents)


def _key(text: str | None) -> str | None:
    return None if text is None else " ".join(text.split()).casefold()


_WORD = re.compile(r"[^\W_]")  # a letter or a digit, in any script


def _word_chars(*texts: str | None) -> float | None:
    """Letters and digits of the poorer of the texts; None (not judged) if any is null or blank:
    no_nulls and no_empty_strings report those, near_empty reports the rest."""
    if any(t is None or not t.strip() for t in texts):
        return None
    return float(min(len(_WORD.findall(t or "")) for t in texts))


def build_frame(data: ds.Dataset, counter: TokenCounter, split: str = "train") -> Any:
    """One row per example: what the expectations look at."""
    import pandas as pd

    prompts, completions = [], []
    for row in data.rows:
        prompt_turns, reference = ds.prompt_and_reference(row["messages"])
        prompts.append(_joined([m["content"] for m in prompt_turns]))
        completions.append(reference if reference is None else _joined([reference]))
    frame = pd.DataFrame(
        {
            "row": data.lines,
            "id": [r["id"] for r in data.rows],
            "prompt": pd.Series(prompts, dtype=object),
            "completion": pd.Series(completions, dtype=object),
            "roles": [",".join(m["role"] for m in r["messages"]) for r in data.rows],
            "n_tokens": counter.count(data, split) if data.rows else [],
            "example_key": [json.dumps([[m["role"], _key(m["content"])] for m in r["messages"]]) for r in data.rows],
            "prompt_key": [_key(p) for p in prompts],
            "word_chars": pd.Series(
                [_word_chars(p, c) for p, c in zip(prompts, completions, strict=True)], dtype="float64"
            ),
        }
    )
    first = frame.groupby("example_key", sort=False)["row"].transform("first")
    frame["duplicate_of"] = first.where(first != frame["row"]).astype("float64")
    return frame


# ------------------------------------------------------------------------------ the expectations


Describe = Callable[[str, dict[str, Any], Callable[[Sequence[int]], str]], str]
"""(split, GX result dict, where) -> the plain-words finding with its fix; ``where(rows)`` names the rows."""


@dataclass(frozen=True)
class Check:
    rule: str  # the data.expectations rule it belongs to (its level decides fail or warn)
    name: str
    expectation: Any
    describe: Describe


_KEY = "data.expectations"
_FRAME_COLUMNS = ("id", "prompt", "completion", "roles", "n_tokens")
_TEXT_COLUMNS = ("prompt", "completion")
_ROW_HAS = ("row has", "rows have")


def _n(count: int, one: str, many: str) -> str:
    """``_n(1, "row has", "rows have")`` -> "1 row has"; plural otherwise."""
    return f"{count} {one if count == 1 else many}"


def _count(result: dict[str, Any]) -> int:
    return int(result.get("unexpected_count") or 0)


def _rows(result: dict[str, Any]) -> list[int]:
    return [int(item["row"]) for item in result.get("unexpected_index_list") or [] if "row" in item]


def _where(rows: Sequence[int], unit: str, filename: str) -> str:
    if not rows:
        return ""
    shown = ", ".join(str(r) for r in rows[:ROWS_IN_MESSAGE])
    return f" ({unit}{'s' if len(rows) > 1 else ''} {shown}{_and_more(rows)} of {filename})"


def _and_more(items: Sequence[Any]) -> str:
    return f" and {len(items) - ROWS_IN_MESSAGE} more" if len(items) > ROWS_IN_MESSAGE else ""


# --------------------------------------------------------------------- findings, in plain words


def _about_rows(subject: tuple[str, str], finding: str, fix: str) -> Describe:
    """A finding about the rows a check flagged: ``<split>: N rows have <finding> (rows ...); <fix>``."""

    def describe(split: str, result: dict[str, Any], where: Callable[[Sequence[int]], str]) -> str:
        return f"{split}: {_n(_count(result), *subject)} {finding}{where(_rows(result))}; {fix}"

    return describe


def _missing_column(column: str) -> Describe:
    return lambda split, result, where: (
        f"{split}: column {column!r} is missing from the validation frame (an internal error; report it)"
    )


def _too_few_rows(min_rows: int) -> Describe:
    def describe(split: str, result: dict[str, Any], where: Callable[[Sequence[int]], str]) -> str:
        fix = (
            f"add examples or lower {_KEY}.row_count.min"
            if split == "train"
            else "give at least one evaluation example"
        )
        return f"{split}: {result.get('observed_value')} rows, fewer than the {min_rows} required; {fix}"

    return describe


def _token_length_outside(bounds: contract.TokenLengthRule) -> Describe:
    def describe(split: str, result: dict[str, Any], where: Callable[[Sequence[int]], str]) -> str:
        items = result.get("unexpected_index_list") or []
        long = [int(i["row"]) for i in items if int(i["n_tokens"]) > bounds.max]
        short = [int(i["row"]) for i in items if int(i["n_tokens"]) < bounds.min]
        parts = []
        if long:
            top = max(int(i["n_tokens"]) for i in items)
            parts.append(
                f"{split}: {_n(len(long), *_ROW_HAS)} more than {bounds.max} tokens{where(long)}, the longest {top}; "
                f"raise {_KEY}.token_length.max or shorten them"
            )
        if short:
            parts.append(
                f"{split}: {_n(len(short), *_ROW_HAS)} fewer than {bounds.min} tokens{where(short)}; "
                f"lower {_KEY}.token_length.min or drop them"
            )
        outside = f"{split}: {_n(_count(result), *_ROW_HAS)} a token length outside [{bounds.min}, {bounds.max}]"
        return "; ".join(parts) or outside

    return describe


def _repeated_examples(max_fraction: float) -> Describe:
    def describe(split: str, result: dict[str, Any], where: Callable[[Sequence[int]], str]) -> str:
        items = result.get("unexpected_index_list") or []
        pairs = ", ".join(f"{int(i['row'])} = {int(i['duplicate_of'])}" for i in items[:ROWS_IN_MESSAGE])
        share = float(result.get("unexpected_percent") or 0.0) / 100
        return (
            f"{split}: {_n(_count(result), 'row repeats', 'rows repeat')} an earlier example exactly "
            f"({pairs}{_and_more(items)}), a share of {share:.3f} > max_fraction {max_fraction}; "
            f"drop the repeats or raise {_KEY}.duplicates.max_fraction"
        )

    return describe


def _prompts_seen_in_train(split: str, result: dict[str, Any], where: Callable[[Sequence[int]], str]) -> str:
    sample = next(iter(result.get("partial_unexpected_list") or []), "")
    return (
        f"{split}: {_n(_count(result), 'prompt also appears', 'prompts also appear')} in train{where(_rows(result))}, "
        f"e.g. {str(sample)[:60]!r}; evaluation on seen prompts flatters the model: remove them from eval (or train)"
    )


# ------------------------------------------------------------- the checks, one builder per rule


@dataclass(frozen=True)
class _Suite:
    """What the check builders of one dataset's suite look at."""

    split: str
    cfg: contract.DataExpectations
    train_prompt_keys: Sequence[str] | None  # for eval: the prompts train has (leakage)

    @property
    def min_rows(self) -> int:
        return self.cfg.row_count.min if self.split == "train" else 1


_Spec = tuple[str, Any, Describe]  # a check without its rule: (name, expectation, describe)


def _gxe() -> Any:
    import great_expectations.expectations as gxe  # imported late: Great Expectations is slow to import

    return gxe


def _columns_present(suite: _Suite) -> list[_Spec]:
    return [(f"column {c} present", _gxe().ExpectColumnToExist(column=c), _missing_column(c)) for c in _FRAME_COLUMNS]


def _row_count(suite: _Suite) -> list[_Spec]:
    expectation = _gxe().ExpectTableRowCountToBeBetween(min_value=suite.min_rows)
    return [("row count", expectation, _too_few_rows(suite.min_rows))]


def _no_nulls(suite: _Suite) -> list[_Spec]:
    return [
        (
            f"{c} not null",
            _gxe().ExpectColumnValuesToNotBeNull(column=c),
            _about_rows(_ROW_HAS, f"no {c} (null)", "fill them in or drop those rows"),
        )
        for c in _TEXT_COLUMNS
    ]


def _no_empty_strings(suite: _Suite) -> list[_Spec]:
    return [
        (
            f"{c} not empty",
            _gxe().ExpectColumnValuesToNotMatchRegex(column=c, regex=r"^\s*$"),
            _about_rows(_ROW_HAS, f"an empty {c}", "write the text or drop those rows"),
        )
        for c in _TEXT_COLUMNS
    ]


def _near_empty(suite: _Suite) -> list[_Spec]:
    min_chars = suite.cfg.near_empty.min_chars
    describe = _about_rows(
        _ROW_HAS,
        f"a prompt or completion with fewer than {min_chars} letter(s) or digit(s)",
        f"write real text, drop those rows or lower {_KEY}.near_empty.min_chars",
    )
    expectation = _gxe().ExpectColumnValuesToBeBetween(column="word_chars", min_value=min_chars)
    return [("prompt and completion hold text", expectation, describe)]


def _token_length(suite: _Suite) -> list[_Spec]:
    bounds = suite.cfg.token_length
    expectation = _gxe().ExpectColumnValuesToBeBetween(column="n_tokens", min_value=bounds.min, max_value=bounds.max)
    return [("token length", expectation, _token_length_outside(bounds))]


def _unique_ids(suite: _Suite) -> list[_Spec]:
    describe = _about_rows(
        ("row shares its", "rows share their"), "id with another row", "make ids unique or drop the id column"
    )
    return [("ids unique", _gxe().ExpectColumnValuesToBeUnique(column="id"), describe)]


def _duplicates(suite: _Suite) -> list[_Spec]:
    max_fraction = suite.cfg.duplicates.max_fraction
    expectation = _gxe().ExpectColumnValuesToBeNull(column="duplicate_of", mostly=1.0 - max_fraction)
    return [("no duplicate examples", expectation, _repeated_examples(max_fraction))]


def _answer_last(suite: _Suite) -> list[_Spec]:
    regex = r"^(?:(?:system|user|assistant),)*assistant$"
    describe = _about_rows(
        ("row does", "rows do"), "not end with an assistant turn", "every example needs its answer last"
    )
    return [
        ("ends with an assistant turn", _gxe().ExpectColumnValuesToMatchRegex(column="roles", regex=regex), describe)
    ]


def _required_roles(suite: _Suite) -> list[_Spec]:
    return [
        (
            f"has a turn with role {role}",
            _gxe().ExpectColumnValuesToMatchRegex(column="roles", regex=rf"(?:^|,){role}(?:,|$)"),
            _about_rows(_ROW_HAS, f"no {role} turn", f"add one or remove {role!r} from {_KEY}.format.required_roles"),
        )
        for role in suite.cfg.format.required_roles
    ]


def _leakage(suite: _Suite) -> list[_Spec]:
    if suite.train_prompt_keys is None:
        return []
    expectation = _gxe().ExpectColumnValuesToNotBeInSet(
        column="prompt_key",
        value_set=list(suite.train_prompt_keys),
        mostly=1.0 - suite.cfg.leakage.max_fraction,
    )
    return [("no prompt shared with train", expectation, _prompts_seen_in_train)]


_CHECK_BUILDERS: tuple[tuple[str, Callable[[_Suite], list[_Spec]]], ...] = (
    # rule -> its checks, in the order the suite runs them (and the report and the error list them)
    ("format", _columns_present),
    ("row_count", _row_count),
    ("no_nulls", _no_nulls),
    ("no_empty_strings", _no_empty_strings),
    ("near_empty", _near_empty),
    ("token_length", _token_length),
    ("unique_ids", _unique_ids),
    ("duplicates", _duplicates),
    ("format", _answer_last),
    ("format", _required_roles),
    ("leakage", _leakage),
)


def build_checks(split: str, cfg: contract.DataExpectations, train_prompt_keys: Sequence[str] | None) -> list[Check]:
    """Every check of one dataset's suite: the checks of each rule, in ``_CHECK_BUILDERS``' order."""
    suite = _Suite(split, cfg, train_prompt_keys)
    return [
        Check(rule, name, expectation, describe)
        for rule, checks_of in _CHECK_BUILDERS
        for name, expectation, describe in checks_of(suite)
    ]


def _gx_context(docs_dir: Path) -> Any:
    """An ephemeral GX context whose one data docs site is ``docs_dir`` (a local folder)."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)  # its INFO lines are noise in task logs
    import_permanently("great_expectations", "great_expectations.expectations")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    context.add_data_docs_site(
        site_name=_DOCS_SITE,
        site_config={
            "class_name": "SiteBuilder",
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
        },
    )
    return context


def build_data_docs(context: Any) -> None:
    """GX renders the suites and the validation results it stored into the site's folder, every
    dataset string in those results HTML-escaped first (``escape_stored_results``)."""
    escape_stored_results(context.validation_results_store)
    context.build_data_docs(site_names=[_DOCS_SITE])


def escape_stored_results(store: Any) -> None:
    """HTML-escape what GX's renderer writes into the data docs unescaped, in every stored result.

    GX's page templates escape nothing (Jinja autoescapes only ``.html``/``.xml`` templates; GX's are
    ``.j2``): the unexpected-values tables write each value, its count and the ids of its rows
    as they are, and the index query and an exception's traceback are written as markup. Those come
    from the dataset (an id, a prompt), so a row holding ``<script>`` would run in the reader's browser.
    Escaped here, once, they read in the page exactly as in the dataset, beside the same row numbers.
    Left to GX: string template parameters (the leakage check's train prompts, an exception's
    message), which GX >= 1.24 escapes itself (escaping them here too would show ``&lt;``).
    data_report.json keeps the values as read (JSON, never rendered as HTML). One call per context.
    """
    for key in store.list_keys():
        suite_result = store.get(key)
        for res in suite_result.results:
            res.result = _html_escaped(res.result)
            _escape_tracebacks(res.exception_info)
        store.set(key, suite_result)


def _html_escaped(value: Any) -> Any:
    """``value`` with every string in it, dictionary keys too, HTML-escaped (quotes included)."""
    if isinstance(value, str):
        return html.escape(value)
    if isinstance(value, dict):
        return {_html_escaped(k): _html_escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_html_escaped(v) for v in value]
    return value


def _escape_tracebacks(info: Any) -> None:
    """Escape each ``exception_traceback`` in a result's exception info (flat, or one per metric)."""
    if not isinstance(info, dict):
        return
    for key, value in info.items():
        if key == "exception_traceback" and isinstance(value, str):
            info[key] = html.escape(value)
        else:
            _escape_tracebacks(value)


def validate(context: Any, split: str, frame: Any, checks: list[Check]) -> list[tuple[Check, Any]]:
    """Run one suite over ``frame``; return each check with its GX result, in the checks' order."""
    import great_expectations as gx

    batch = (
        context.data_sources.add_pandas(split).add_dataframe_asset(split).add_batch_definition_whole_dataframe(split)
    )
    suite = gx.ExpectationSuite(name=f"{split}_dataset")
    for i, check in enumerate(checks):
        check.expectation.meta = {"check": i}
        suite.add_expectation(check.expectation)
    suite = context.suites.add(suite)
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=split, data=batch, suite=suite))
    result = definition.run(
        batch_parameters={"dataframe": frame},
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["row"]},
    )
    by_index = {int(r.expectation_config.meta["check"]): r for r in result.results}
    return [(check, by_index[i]) for i, check in enumerate(checks)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value


def _observed(res: Any) -> str:
    """What the expectation saw, in a few words (the report's 'observed' column)."""
    r = res.result or {}
    if r.get("unexpected_count") is not None:
        count, total = int(r["unexpected_count"]), r.get("element_count")
        percent = float(r.get("unexpected_percent") or 0.0)
        return f"{count} of {total} rows ({percent:.1f}%)" if total is not None else f"{count} rows"
    if r.get("observed_value") is not None:
        return str(r["observed_value"])
    return ""


def _result_entry(split: str, check: Check, res: Any, level: str, message: str | None) -> dict[str, Any]:
    r = res.result or {}
    items = r.get("unexpected_index_list") or []
    entry = {
        "dataset": split,
        "rule": check.rule,
        "level": level,
        "outcome": contract.outcome(bool(res.success), level),  # type: ignore[arg-type]
        "check": check.name,
        "type": res.expectation_config.type,
        "column": res.expectation_config.kwargs.get("column"),
        "success": bool(res.success),
        "observed": _observed(res),
        "unexpected_count": r.get("unexpected_count"),
        "unexpected_percent": r.get("unexpected_percent"),
        "observed_value": r.get("observed_value"),
        "unexpected_examples": items[:EXAMPLES_IN_REPORT],
        "message": message,
    }
    if res.exception_info and res.exception_info.get("raised_exception"):
        entry["exception"] = res.exception_info.get("exception_message")
    return _jsonable(entry)


# ------------------------------------------------------------------------------------------ run


def run(ctx: StepContext) -> dict[str, Any]:
    cfg = resolve_config(dict(ctx.config))
    report: dict[str, Any] = {"config": {"expectations": cfg.model_dump(mode="json")}}
    loaded = _load_splits(ctx, report)
    counter = TokenCounter(ctx.inputs["tokenizer"], parse(ValidateDataConfig, dict(ctx.config)).chat_template)
    report["token_length"] = counter.method
    report["chat_template"] = counter.template.summary()
    ctx.progress(f"chat template: {counter.template.origin} (sha256 {counter.template.digest[:12]})")
    frames = {split: build_frame(loaded[split], counter, split) for split in SPLITS}
    if counter.refused:
        report["success"] = False
        report["chat_template_refused"] = [list(r) for r in counter.refused]
        _write_report(ctx.out, report)
        counter.raise_if_refused(loaded)
    suites = _run_suites(ctx.out / DATA_DOCS, cfg, frames)
    findings = _judge(ctx, cfg, loaded, suites.results)
    docs_seconds = _write_data_docs(ctx, suites.context)
    stats = {split: _split_statistics(loaded[split], frames[split]) for split in SPLITS}
    report |= _report_outcome(findings, suites, docs_seconds, stats)
    _write_report(ctx.out, report)
    if findings.failures:
        raise DataValidationError(contract.contract_broken_message(findings.failures))
    _write_accepted_data(ctx.out, loaded)
    chat_template.write_record(counter.template, ctx.out)
    return _accepted_summary(ctx, suites, findings, stats) | {"chat_template": counter.template.summary()}


def _write_report(out: Path, report: dict[str, Any]) -> None:
    (out / DATA_REPORT).write_text(json.dumps(_jsonable(report), indent=2, sort_keys=True, ensure_ascii=False))


def _load_splits(ctx: StepContext, report: dict[str, Any]) -> dict[str, ds.Dataset]:
    """Both datasets, loaded; if either cannot be read, the report says why and the stage fails."""
    loaded: dict[str, ds.Dataset] = {}
    problems: list[str] = []
    for split in SPLITS:
        if split not in ctx.inputs:
            raise LoraflowError(f"{STAGE}: input {split!r} is missing; give --input {split}=gs://...")
        try:
            path = ds.find_dataset_file(ctx.inputs[split])
            loaded[split] = ds.load(path, id_prefix=f"{split}-")
        except DataValidationError as exc:
            problems.append(f"{split}: {exc}")
            continue
        ctx.progress(f"{split}: {len(loaded[split].rows)} rows loaded from {path.name} ({loaded[split].format} format)")
    if problems:
        report |= {"load_problems": problems, "success": False}
        _write_report(ctx.out, report)
        raise DataValidationError("the dataset cannot be read:\n" + "\n".join(problems))
    return loaded


@dataclass(frozen=True)
class _SuiteRuns:
    """Both suites run by Great Expectations: each check's result, and how long it took."""

    context: Any
    results: list[tuple[str, Check, Any]]  # (split, check, GX result), train's then eval's
    context_seconds: float  # making the GX context (mostly importing Great Expectations)
    validate_seconds: dict[str, float]
    seconds: float  # all of it


def _run_suites(docs_dir: Path, cfg: contract.DataExpectations, frames: dict[str, Any]) -> _SuiteRuns:
    started = time.monotonic()
    context = _gx_context(docs_dir)
    context_seconds = time.monotonic() - started
    results: list[tuple[str, Check, Any]] = []
    validate_seconds: dict[str, float] = {}
    for split in SPLITS:
        train_keys = sorted({k for k in frames["train"]["prompt_key"] if k}) if split == "eval" else None
        checks = build_checks(split, cfg, train_keys)
        t0 = time.monotonic()
        results += [(split, c, r) for c, r in validate(context, split, frames[split], checks)]
        validate_seconds[split] = round(time.monotonic() - t0, 3)
    return _SuiteRuns(context, results, context_seconds, validate_seconds, time.monotonic() - started)


@dataclass(frozen=True)
class _Findings:
    entries: list[dict[str, Any]]  # the report's line of every check
    failures: list[tuple[str, str]]  # (rule, message) of fail-level findings
    warnings: list[tuple[str, str]]  # (rule, message) of warn-level findings


def _judge(
    ctx: StepContext,
    cfg: contract.DataExpectations,
    loaded: dict[str, ds.Dataset],
    results: list[tuple[str, Check, Any]],
) -> _Findings:
    """Each check's outcome at its rule's level, logged as it is judged."""
    findings = _Findings([], [], [])
    for split, check, res in results:
        level = cfg.level(check.rule)
        message = None if res.success else _finding(split, check, res, loaded[split])
        findings.entries.append(_result_entry(split, check, res, level, message))
        if message is not None:
            (findings.warnings if level == "warn" else findings.failures).append((check.rule, message))
        ctx.progress(f"{split}: [{check.rule}] {check.name}: {_verdict(level, message)}")
    return findings


def _finding(split: str, check: Check, res: Any, data: ds.Dataset) -> str:
    """What a failed check found, in plain words, naming the rows of the dataset's file."""
    return check.describe(split, res.result or {}, functools.partial(_where, unit=data.unit, filename=data.path.name))


def _verdict(level: str, message: str | None) -> str:
    if message is None:
        return "ok"
    if level == "warn":
        return f"WARNING (rule level warn, the run continues): {message}"
    return f"FAILED: {message}"


def _write_data_docs(ctx: StepContext, context: Any) -> float:
    t0 = time.monotonic()
    build_data_docs(context)
    seconds = round(time.monotonic() - t0, 3)
    ctx.progress(f"Great Expectations data docs written to {DATA_DOCS}/index.html ({seconds:.2f} s)")
    return seconds


def _split_statistics(data: ds.Dataset, frame: Any) -> dict[str, Any]:
    tokens = frame["n_tokens"]
    return {
        "rows": len(frame),
        "format": data.format,
        "file": data.path.name,
        "tokens_min": int(tokens.min()) if len(frame) else 0,
        "tokens_mean": round(float(tokens.mean()), 2) if len(frame) else 0.0,
        "tokens_max": int(tokens.max()) if len(frame) else 0,
    }


def _report_outcome(
    findings: _Findings, suites: _SuiteRuns, docs_seconds: float, stats: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The report's verdict, every check's line and the statistics."""
    failures, warnings = findings.failures, findings.warnings
    unsuccessful = sum(1 for e in findings.entries if not e["success"])
    return {
        "success": not failures,
        "failures": [m for _, m in failures],
        "failed_rules": _rules_of(failures),
        "warnings": [m for _, m in warnings],
        "warned_rules": _rules_of(warnings),
        "expectations": findings.entries,
        "data_docs": f"{DATA_DOCS}/index.html",
        "statistics": {
            "evaluated_expectations": len(suites.results),
            "successful_expectations": len(suites.results) - unsuccessful,
            "unsuccessful_expectations": unsuccessful,
            "warned_expectations": len(warnings),
            "failed_expectations": len(failures),
            "gx_seconds": round(suites.seconds, 3),
            "gx_context_seconds": round(suites.context_seconds, 3),
            "gx_validate_seconds": suites.validate_seconds,
            "gx_data_docs_seconds": docs_seconds,
            **stats,
        },
    }


def _rules_of(findings: list[tuple[str, str]]) -> list[str]:
    """The rules of ``(rule, message)`` findings, each once, in order."""
    return list(dict.fromkeys(rule for rule, _ in findings))


def _write_accepted_data(out: Path, loaded: dict[str, ds.Dataset]) -> None:
    """train.jsonl as loaded; eval.jsonl split into the prompt turns and the reference answer."""
    ds.write_jsonl(loaded["train"].rows, out / "train.jsonl")
    eval_rows = []
    for row in loaded["eval"].rows:
        prompt, reference = ds.prompt_and_reference(row["messages"])
        eval_rows.append({"id": row["id"], "messages": prompt, "reference": reference})
    ds.write_jsonl(eval_rows, out / "eval.jsonl")


def _accepted_summary(
    ctx: StepContext, suites: _SuiteRuns, findings: _Findings, stats: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Log the closing line; return the manifest summary of an accepted dataset."""
    evaluated, warned = len(suites.results), len(findings.warnings)
    max_seen = max(int(s["tokens_max"]) for s in stats.values())
    ctx.progress(
        f"{evaluated - warned} of {evaluated} expectations passed, {warned} warning(s), in {suites.seconds:.2f} s "
        f"({suites.context_seconds:.2f} s of it importing Great Expectations); longest example {max_seen} tokens"
    )
    return {
        "train_rows": stats["train"]["rows"],
        "eval_rows": stats["eval"]["rows"],
        "expectations": evaluated,
        "failed": 0,
        "warnings": warned,
        "warned_rules": _rules_of(findings.warnings),
        "max_tokens_seen": max_seen,
        "data_docs": f"{DATA_DOCS}/index.html",
    }


if __name__ == "__main__":
    run_and_exit(STAGE, run)
