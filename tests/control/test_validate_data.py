"""validate_data.run: the parity data passes and is normalised; each data-quality failure is named."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow.errors import DataValidationError
from loraflow.steps import validate_data
from tests.bad_datasets import SCRIPT_PAYLOADS, script_payload_rows
from tests.control.conftest import task_inputs

PARITY = Path(__file__).resolve().parents[2] / "pipelines" / "data" / "parity"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def contract(**rules: dict) -> dict:
    """The stage config for these data.expectations rules (the rest keep their defaults)."""
    return {"expectations": rules}


PARITY_TRAIN = read_jsonl(PARITY / "train.jsonl")
PARITY_EVAL = read_jsonl(PARITY / "eval.jsonl")


def dataset_dir(root: Path, name: str, rows: list[dict] | str, fmt: str = "jsonl") -> Path:
    """A directory holding one dataset file: ``rows`` written as JSONL or Parquet, or a raw text."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(rows, str):
        (d / f"{name}.jsonl").write_text(rows)
    elif fmt == "parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(d / f"{name}.parquet")
    else:
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture
def run_step(tmp_path: Path, tokenizer_dir: Path, make_ctx: Callable) -> Callable:
    """run_step(train_rows, eval_rows, **config) -> (summary or the error, ctx)."""

    def run(train: list[dict], eval_: list[dict], fmt: str = "jsonl", **config):  # type: ignore[no-untyped-def]
        inputs = {
            "train": dataset_dir(tmp_path / "in", "train", train, fmt),
            "eval": dataset_dir(tmp_path / "in", "eval", eval_, fmt),
            "tokenizer": tokenizer_dir,
        }
        ctx = make_ctx("validate_data", inputs, config)
        try:
            return validate_data.run(ctx), ctx
        except DataValidationError as exc:
            return exc, ctx

    return run


def test_parity_data_passes_and_is_normalised(tmp_path: Path, tokenizer_dir: Path, make_ctx: Callable) -> None:
    inputs = task_inputs(tmp_path, PARITY, tokenizer_dir)
    ctx = make_ctx("validate_data", inputs, contract(row_count={"min": 1000}, token_length={"max": 32}))
    summary = validate_data.run(ctx)

    assert summary["train_rows"] == 2000 and summary["eval_rows"] == 400
    assert summary["failed"] == 0 and summary["expectations"] >= 20
    assert 1 <= summary["max_tokens_seen"] <= 32
    train = read_jsonl(ctx.out / "train.jsonl")
    assert train[0] == {
        "id": "train-000001",
        "messages": [
            {"role": "user", "content": PARITY_TRAIN[0]["prompt"]},
            {"role": "assistant", "content": PARITY_TRAIN[0]["completion"]},
        ],
    }
    evals = read_jsonl(ctx.out / "eval.jsonl")
    assert evals[0] == {
        "id": "eval-000001",
        "messages": [{"role": "user", "content": PARITY_EVAL[0]["prompt"]}],
        "reference": PARITY_EVAL[0]["completion"],
    }
    report = json.loads((ctx.out / "data_report.json").read_text())
    assert report["success"] is True
    assert report["statistics"]["train"]["rows"] == 2000
    assert "chat_template" in report["token_length"]
    types = {e["type"] for e in report["expectations"]}
    assert {
        "expect_column_values_to_be_between",
        "expect_table_row_count_to_be_between",
        "expect_column_values_to_not_be_in_set",
        "expect_column_values_to_be_null",
    } <= types


def test_chat_parquet_input(run_step: Callable) -> None:
    def chat(row: dict) -> dict:
        return {
            "messages": [
                {"role": "system", "content": "One word."},
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ]
        }

    summary, ctx = run_step(
        [chat(r) for r in PARITY_TRAIN[:30]],
        [chat(r) for r in PARITY_EVAL[:5]],
        fmt="parquet",
        **contract(row_count={"min": 30}, format={"required_roles": ["system", "user", "assistant"]}),
    )
    assert not isinstance(summary, Exception), summary
    assert summary["train_rows"] == 30
    first_eval = read_jsonl(ctx.out / "eval.jsonl")[0]
    assert [m["role"] for m in first_eval["messages"]] == ["system", "user"]
    assert first_eval["reference"] == PARITY_EVAL[0]["completion"]


def _train(n: int = 20) -> list[dict]:
    return [dict(r) for r in PARITY_TRAIN[:n]]


def _eval(n: int = 5) -> list[dict]:
    return [dict(r) for r in PARITY_EVAL[:n]]


def _with(rows: list[dict], changes: dict[int, dict]) -> list[dict]:
    for index, change in changes.items():
        rows[index] = {**rows[index], **change}
    return rows


# name -> (train rows, eval rows, config, fragments the error must hold)
FAILURES: dict[str, tuple[list[dict], list[dict], dict, list[str]]] = {
    "null_completion": (
        _with(_train(), {3: {"completion": None}, 8: {"completion": None}}),
        _eval(),
        contract(row_count={"min": 20}),
        ["train: 2 rows have no completion (null)", "lines 4, 9 of train.jsonl"],
    ),
    "empty_prompt": (
        _with(_train(), {5: {"prompt": "   "}}),
        _eval(),
        contract(row_count={"min": 20}),
        ["train: 1 row has an empty prompt", "line 6 of train.jsonl"],
    ),
    "empty_completion_in_eval": (
        _train(),
        _with(_eval(), {1: {"completion": ""}}),
        contract(row_count={"min": 20}),
        ["eval: 1 row has an empty completion", "line 2 of eval.jsonl"],
    ),
    "too_long": (
        _with(_train(), {4: {"prompt": "Is 1 even or odd? " * 20}, 16: {"prompt": "Is 2 even or odd? " * 30}}),
        _eval(),
        contract(row_count={"min": 20}, token_length={"max": 32}),
        [
            "train: 2 rows have more than 32 tokens",
            "lines 5, 17 of train.jsonl",
            "raise data.expectations.token_length.max or shorten them",
        ],
    ),
    "too_short": (
        _train(),
        _eval(),
        contract(row_count={"min": 20}, token_length={"min": 17, "max": 64}),
        ["train: 20 rows have fewer than 17 tokens", "lower data.expectations.token_length.min"],
    ),
    "duplicates": (
        _with(_train(), {7: PARITY_TRAIN[2], 11: PARITY_TRAIN[2]}),
        _eval(),
        contract(row_count={"min": 20}),
        [
            "train: 2 rows repeat an earlier example exactly (8 = 3, 12 = 3)",
            "raise data.expectations.duplicates.max_fraction",
        ],
    ),
    "too_few_rows": (
        _train(10),
        _eval(),
        contract(row_count={"min": 100}),
        ["train: 10 rows, fewer than the 100 required", "add examples or lower data.expectations.row_count.min"],
    ),
    "train_eval_overlap": (
        _train(),
        _with(_eval(), {0: PARITY_TRAIN[6], 3: {"prompt": PARITY_TRAIN[9]["prompt"].upper()}}),
        contract(row_count={"min": 20}),
        ["eval: 2 prompts also appear in train", "lines 1, 4 of eval.jsonl", "remove them from eval"],
    ),
    "duplicate_ids": (
        [dict(r, id="x" if i in (2, 5) else f"r{i}") for i, r in enumerate(_train())],
        _eval(),
        contract(row_count={"min": 20}),
        ["train: 2 rows share their id", "lines 3, 6 of train.jsonl", "make ids unique"],
    ),
    "missing_required_role": (
        _train(),
        _eval(),
        contract(row_count={"min": 20}, format={"required_roles": ["system", "user", "assistant"]}),
        [
            "train: 20 rows have no system turn",
            "remove 'system' from data.expectations.format.required_roles",
            "eval: 5 rows have no system turn",
        ],
    ),
    "no_final_assistant_turn": (
        [
            *[
                {
                    "messages": [
                        {"role": "user", "content": r["prompt"]},
                        {"role": "assistant", "content": r["completion"]},
                    ]
                }
                for r in _train()
            ][:-1],
            {"messages": [{"role": "user", "content": "Is 5 even or odd?"}]},
        ],
        [
            {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for r in _eval()
        ],
        contract(row_count={"min": 20}),
        [
            "train: 1 row does not end with an assistant turn",
            "line 20 of train.jsonl",
            "train: 1 row has no assistant turn",
        ],
    ),
    "unreadable_eval_file": (
        _train(),
        '{"prompt": "x", "completion": "y"}\n{"prompt": \n',
        contract(row_count={"min": 20}),
        ["the dataset cannot be read", "eval:", "eval.jsonl", "line 2", "invalid JSON"],
    ),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_failures_name_the_problem_and_rows(run_step: Callable, case: str) -> None:
    train, eval_, config, fragments = FAILURES[case]
    result, ctx = run_step(train, eval_, **config)
    assert isinstance(result, DataValidationError), f"expected a failure, got {result}"
    message = str(result)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    # The evidence is written before the error (the report, GX's data docs once GX ran), and nothing else is.
    report = json.loads((ctx.out / "data_report.json").read_text())
    assert report["success"] is False
    written = sorted(p.name for p in ctx.out.iterdir())
    if "load_problems" in report:
        assert written == ["data_report.json"]
    else:
        assert written == ["data_docs", "data_report.json"]
        assert (ctx.out / "data_docs" / "index.html").is_file()
        assert message.startswith("the data contract is broken")
        for rule in report["failed_rules"]:
            assert f"[{rule}]" in message


def test_report_lists_every_expectation_with_examples(run_step: Callable) -> None:
    train = _with(_train(), {4: {"prompt": "Is 1 even or odd? " * 20}})
    result, ctx = run_step(train, _eval(), **contract(row_count={"min": 20}, token_length={"max": 32}))
    assert isinstance(result, DataValidationError)
    report = json.loads((ctx.out / "data_report.json").read_text())
    failed = [e for e in report["expectations"] if not e["success"]]
    assert len(failed) == 1
    entry = failed[0]
    assert entry["dataset"] == "train" and entry["column"] == "n_tokens"
    assert entry["type"] == "expect_column_values_to_be_between"
    assert entry["unexpected_count"] == 1 and entry["unexpected_examples"][0]["row"] == 5
    assert report["statistics"]["unsuccessful_expectations"] == 1


def test_duplicates_within_the_allowed_fraction_pass(run_step: Callable) -> None:
    train = _with(_train(), {7: PARITY_TRAIN[2]})
    summary, _ = run_step(train, _eval(), **contract(row_count={"min": 20}, duplicates={"max_fraction": 0.1}))
    assert not isinstance(summary, Exception), summary


def test_unknown_config_key_is_refused(run_step: Callable) -> None:
    from loraflow.errors import LoraflowError

    with pytest.raises(LoraflowError, match="unknown config key"):
        run_step(_train(), _eval(), max_token=32)
    with pytest.raises(LoraflowError, match=r"data.max_tokens moved: write data.expectations.token_length.max"):
        run_step(_train(), _eval(), max_tokens=32)
    with pytest.raises(LoraflowError, match=r"expectations.leakage.level: Input should be 'fail' or 'warn'"):
        run_step(_train(), _eval(), **contract(leakage={"level": "error"}))


def test_one_error_names_every_failed_rule_and_its_fix(run_step: Callable) -> None:
    train = _with(_train(), {3: {"completion": ""}, 10: PARITY_TRAIN[11]})
    result, ctx = run_step(train, _eval(), **contract(row_count={"min": 50}))
    assert isinstance(result, DataValidationError)
    message = str(result)
    assert message.startswith("the data contract is broken: 3 rule(s) failed (row_count, no_empty_strings, duplicates)")
    assert "[row_count] train: 20 rows, fewer than the 50 required" in message
    assert "[no_empty_strings] train: 1 row has an empty completion (line 4 of train.jsonl)" in message
    assert "[duplicates] train: 1 row repeats an earlier example exactly (12 = 11)" in message
    assert "set data.expectations.RULE.level: warn" in message
    report = json.loads((ctx.out / "data_report.json").read_text())
    assert report["failed_rules"] == ["row_count", "no_empty_strings", "duplicates"]
    outcomes = {
        (e["dataset"], e["check"]): (e["rule"], e["level"], e["outcome"], e["observed"]) for e in report["expectations"]
    }
    assert outcomes[("train", "completion not empty")] == ("no_empty_strings", "fail", "fail", "1 of 20 rows (5.0%)")
    assert outcomes[("train", "row count")] == ("row_count", "fail", "fail", "20")
    assert outcomes[("train", "prompt and completion hold text")][2] == "pass"  # a blank is reported once
    assert outcomes[("eval", "row count")] == ("row_count", "fail", "pass", "5")


def test_warn_level_rules_are_recorded_and_the_data_is_accepted(run_step: Callable) -> None:
    train = _with(_train(), {2: {"completion": "..."}, 10: PARITY_TRAIN[11]})
    eval_ = _with(_eval(), {0: PARITY_TRAIN[6]})
    # near_empty warns by default; duplicates and leakage are lowered to warn here.
    summary, ctx = run_step(
        train, eval_, **contract(row_count={"min": 20}, duplicates={"level": "warn"}, leakage={"level": "warn"})
    )
    assert not isinstance(summary, Exception), summary
    assert summary["warnings"] == 3 and summary["warned_rules"] == ["near_empty", "duplicates", "leakage"]
    assert len(read_jsonl(ctx.out / "train.jsonl")) == 20  # accepted as given
    report = json.loads((ctx.out / "data_report.json").read_text())
    assert report["success"] is True and report["failures"] == []
    assert any("line 3 of train.jsonl" in w and "fewer than 1 letter(s) or digit(s)" in w for w in report["warnings"])
    assert any(w.startswith("eval: 1 prompt also appears in train") for w in report["warnings"])
    warned = {e["rule"] for e in report["expectations"] if e["outcome"] == "warn"}
    assert warned == {"near_empty", "duplicates", "leakage"}
    assert report["statistics"]["warned_expectations"] == 3


def test_near_empty_at_fail_level_stops_the_run(run_step: Callable) -> None:
    train = _with(_train(), {5: {"prompt": "? ?"}})
    result, _ = run_step(
        train, _eval(), **contract(row_count={"min": 20}, near_empty={"level": "fail", "min_chars": 2})
    )
    assert isinstance(result, DataValidationError)
    assert "(near_empty)" in str(result) and "line 6 of train.jsonl" in str(result)


def test_data_docs_are_built_by_great_expectations(run_step: Callable) -> None:
    train = _with(_train(), {4: {"prompt": "Is 1 even or odd? " * 20}})
    _, ctx = run_step(train, _eval(), **contract(row_count={"min": 20}, token_length={"max": 32}))
    docs = ctx.out / "data_docs"
    index = (docs / "index.html").read_text()
    assert "train_dataset" in index and "eval_dataset" in index
    pages = sorted(docs.glob("validations/**/*.html"))
    assert len(pages) == 2, pages  # one validation result page per suite
    train_page = next(p for p in pages if "train_dataset" in str(p)).read_text()
    assert "n_tokens" in train_page and "Failed" in train_page


def test_dataset_strings_reach_the_data_docs_escaped(run_step: Callable) -> None:
    """Ids and prompts carrying markup are shown as text in every page GX writes, never as markup
    (they used to land raw in the unexpected-values tables: script from a dataset ran in the reader's
    browser); data_report.json keeps them as read, beside the rows that failed."""
    train, eval_ = script_payload_rows()
    result, ctx = run_step(train, eval_, **contract(row_count={"min": 100}, token_length={"max": 64}))
    assert isinstance(result, DataValidationError)
    assert "[unique_ids] train: 6 rows share their id" in str(result) and "[leakage] eval: 1 prompt" in str(result)
    docs = ctx.out / "data_docs"
    pages = {p.relative_to(docs).as_posix(): p.read_text() for p in docs.rglob("*.html")}
    assert len(pages) == 5, sorted(pages)  # the index, both suites, both validation results
    for name, text in pages.items():
        for raw in ("<script>window", "<img src=x", "<svg onload"):
            assert raw not in text, f"{name} writes {raw!r} raw"
        assert "&amp;lt;" not in text, f"{name} escapes a value twice"
    train_page = next(text for name, text in pages.items() if name.startswith("validations/train_dataset/"))
    for payload in SCRIPT_PAYLOADS:  # each id as the reader typed it, in the table of the rows sharing it
        assert html.escape(payload) in train_page
    eval_page = next(text for name, text in pages.items() if name.startswith("validations/eval_dataset/"))
    assert html.escape(train[11]["prompt"].casefold()) in eval_page  # the leaked prompt, as text
    report = json.loads((ctx.out / "data_report.json").read_text())
    ids = next(e for e in report["expectations"] if e["dataset"] == "train" and e["rule"] == "unique_ids")
    assert ids["unexpected_examples"][:2] == [{"id": SCRIPT_PAYLOADS[0], "row": row} for row in (1, 2)]


def test_stored_results_and_exception_tracebacks_are_escaped_once() -> None:
    """What GX writes as markup (result fields, tracebacks: an exception may quote a value) is
    escaped; what it escapes itself (an exception's message, a template parameter) is left alone."""
    from types import SimpleNamespace

    payload = SCRIPT_PAYLOADS[1]
    flat = {"raised_exception": True, "exception_message": payload, "exception_traceback": payload}
    per_metric = {("metric", "id"): dict(flat)}
    results = [
        SimpleNamespace(result={"partial_unexpected_list": [payload, None, 3]}, exception_info=flat),
        SimpleNamespace(result={"unexpected_index_list": [{"id": payload, "row": 2}]}, exception_info=per_metric),
    ]
    stored = {"key": SimpleNamespace(results=results)}
    store = SimpleNamespace(list_keys=lambda: list(stored), get=stored.__getitem__, set=stored.__setitem__)
    validate_data.escape_stored_results(store)
    escaped = html.escape(payload)
    assert results[0].result == {"partial_unexpected_list": [escaped, None, 3]}
    assert results[1].result == {"unexpected_index_list": [{"id": escaped, "row": 2}]}
    for info in (flat, per_metric[("metric", "id")]):
        assert info == {"raised_exception": True, "exception_message": payload, "exception_traceback": escaped}


def test_a_role_carrying_markup_is_refused_before_any_page_is_written(run_step: Callable) -> None:
    train = [dict(r) for r in PARITY_TRAIN[:20]]
    chat = [{"role": SCRIPT_PAYLOADS[0], "content": "Is 1 even?"}, {"role": "assistant", "content": "odd"}]
    result, ctx = run_step([*train[:19], {"messages": chat}], _eval(), **contract(row_count={"min": 20}))
    assert isinstance(result, DataValidationError) and "invalid role" in str(result)
    assert sorted(p.name for p in ctx.out.iterdir()) == ["data_report.json"]


class _TI:
    """The bits of a task instance the operator uses."""

    def __init__(self) -> None:
        self.pushed: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.pushed[key] = value


def test_the_task_links_the_data_docs_of_the_accepted_or_the_rejected_data(
    gcs_bucket: str,
) -> None:
    import os

    import yaml

    from loraflow.pipeline.plan import output_prefix
    from loraflow.reporting import urls
    from loraflow.spec.schema import validate_spec
    from loraflow.storage import artifacts, gcs
    from operators.links import DataDocsLink
    from operators.stages import ValidateDataOperator

    assert "Data docs" in [link.name for link in ValidateDataOperator.operator_extra_links]
    data = yaml.safe_load((PARITY.parents[1] / "tiny-llama-lora.yaml").read_text()) | {"artifact_root": gcs_bucket}
    op = ValidateDataOperator.for_spec(data)
    host = os.environ["STORAGE_EMULATOR_HOST"]  # the session's emulator (tests/conftest.py)
    ti = _TI()
    context = {"ti": ti, "run_id": "manual__2026-12-03T01:00:00+00:00", "params": {}}
    rejected = gcs.join(output_prefix(validate_spec(data, "t"), context["run_id"], "validate_data"), "_rejected")

    op.link_data_docs(context, committed=None)  # the data could not even be read: no docs, no link
    assert DataDocsLink().xcom_key not in ti.pushed
    artifacts.write_json(gcs.join(rejected, "data_docs", "index.html"), {})  # stands in for GX's page
    op.link_data_docs(context, committed=None)
    assert ti.pushed[DataDocsLink().xcom_key] == urls.site_url(gcs.join(rejected, "data_docs", "index.html"), host)
    op.link_data_docs(context, committed=f"{gcs_bucket}/tiny-llama-lora/run-0/validate_data")  # a cache hit
    assert ti.pushed[DataDocsLink().xcom_key] == (
        f"{host.rstrip('/')}/{gcs.split_uri(gcs_bucket)[0]}/{gcs.split_uri(gcs_bucket)[1]}"
        "/tiny-llama-lora/run-0/validate_data/data_docs/index.html"
    )
