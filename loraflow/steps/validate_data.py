"""Step program for the validate_data stage: the dataset's contract, checked before any TPU time.

Inputs (local directories, fetched by the harness):
    train       one dataset file (JSONL or Parquet; prompt/completion or chat messages)
    eval        one dataset file, same formats
    tokenizer   an HF checkpoint directory holding tokenizer.json (+ tokenizer_config.json)

Config (every key optional)::

    min_rows: 100                  train must have at least this many rows (eval: at least 1)
    max_tokens: 128                no example may be longer (whole rendered conversation)
    min_tokens: 1                  ... nor shorter
    max_duplicate_fraction: 0.0    share of rows that may repeat an earlier example exactly
    required_roles: [user, assistant]   roles every example must contain

Two layers of checks. First the loader (loraflow.dataset) checks structure: the file decodes,
each line is a JSON object, the columns and roles are known; it reports every problem with its
line. Then a Great Expectations suite per dataset checks content on a flat frame with one row per
example: required columns present, no null or blank prompt/completion, token length within
bounds, unique ids, no duplicate examples, enough rows, roles valid (last turn an assistant
answer, required roles present) and, for eval, no prompt that also appears in train.

Token length = number of tokens of the conversation rendered with the checkpoint's chat template
(``tokenizer_config.json`` ``chat_template``, i.e. the text the trainer sees, special tokens
included), encoded with ``add_special_tokens=False`` since the template writes them itself. A
checkpoint without a template is rendered as ``role: content`` lines; the report says which.

Outputs: train.jsonl ({"id", "messages"}), eval.jsonl ({"id", "messages": the prompt turns,
"reference": the answer}) and data_report.json (every expectation's result and statistics). On
any failure only data_report.json is written and DataValidationError lists every failed check in
plain words; the harness keeps the report under ``<output>/_rejected/`` and commits nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow import dataset as ds
from loraflow.errors import DataValidationError, LoraflowError
from loraflow.steps._harness import StepContext, run_step

STAGE = "validate_data"
DEFAULTS: dict[str, Any] = {
    "min_rows": 100,
    "max_tokens": 128,
    "min_tokens": 1,
    "max_duplicate_fraction": 0.0,
    "required_roles": ["user", "assistant"],
}
SPLITS = ("train", "eval")
EXAMPLES_IN_REPORT = 5
ROWS_IN_MESSAGE = 5


@dataclass(frozen=True)
class Config:
    min_rows: int
    max_tokens: int
    min_tokens: int
    max_duplicate_fraction: float
    required_roles: tuple[str, ...]


def resolve_config(raw: dict[str, Any]) -> Config:
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise LoraflowError(f"{STAGE}: unknown config key(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    merged = {**DEFAULTS, **raw}
    problems = []
    for key in ("min_rows", "max_tokens", "min_tokens"):
        if not isinstance(merged[key], int) or isinstance(merged[key], bool) or merged[key] < 0:
            problems.append(f"{key} must be a non-negative integer (got {merged[key]!r})")
    frac = merged["max_duplicate_fraction"]
    if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0.0 <= frac <= 1.0:
        problems.append(f"max_duplicate_fraction must be a number in [0, 1] (got {frac!r})")
    roles = merged["required_roles"]
    if not isinstance(roles, list) or any(r not in ds.ROLES for r in roles):
        problems.append(f"required_roles must be a list drawn from {', '.join(ds.ROLES)} (got {roles!r})")
    if not problems and merged["min_tokens"] > merged["max_tokens"]:
        problems.append(f"min_tokens ({merged['min_tokens']}) is above max_tokens ({merged['max_tokens']})")
    if problems:
        raise LoraflowError(f"{STAGE}: invalid config: " + "; ".join(problems))
    return Config(
        int(merged["min_rows"]),
        int(merged["max_tokens"]),
        int(merged["min_tokens"]),
        float(frac),
        tuple(roles),
    )


# ------------------------------------------------------------------------------- token counting


class TokenCounter:
    """Counts tokens of a conversation as the trainer will see it (see the module docstring)."""

    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer

        found = sorted(checkpoint_dir.rglob("tokenizer.json"))
        if not found:
            raise LoraflowError(
                f"{STAGE}: no tokenizer.json under the tokenizer input ({checkpoint_dir}); "
                "point it at an HF checkpoint with a fast tokenizer"
            )
        self.tokenizer = Tokenizer.from_file(str(found[0]))
        self.template = None
        self.method = "role: content lines (the checkpoint has no chat_template)"
        cfg_path = found[0].parent / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        if cfg.get("chat_template"):
            self.template = _compile_template(cfg["chat_template"])
            self.method = "chat_template of tokenizer_config.json, add_special_tokens=False"
            self.specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        turns = [{"role": m["role"], "content": m["content"] or ""} for m in messages]
        if self.template is None:
            return "\n".join(f"{m['role']}: {m['content']}" for m in turns)
        return str(self.template.render(messages=turns, add_generation_prompt=False, **self.specials))

    def count(self, conversations: Sequence[Sequence[dict[str, Any]]]) -> list[int]:
        texts = [self.render(m) for m in conversations]
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _compile_template(source: str) -> Any:
    """Compile an HF chat template the way transformers does (sandboxed, trimmed, {% generation %})."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' AssistantTracker, minus the mask bookkeeping
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise LoraflowError(f"{STAGE}: the chat template refused a conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


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


def build_frame(data: ds.Dataset, counter: TokenCounter) -> Any:
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
            "n_tokens": counter.count([r["messages"] for r in data.rows]) if data.rows else [],
            "example_key": [json.dumps([[m["role"], _key(m["content"])] for m in r["messages"]]) for r in data.rows],
            "prompt_key": [_key(p) for p in prompts],
        }
    )
    first = frame.groupby("example_key", sort=False)["row"].transform("first")
    frame["duplicate_of"] = first.where(first != frame["row"]).astype("float64")
    return frame


# ------------------------------------------------------------------------------ the expectations


@dataclass(frozen=True)
class Check:
    name: str
    expectation: Any
    describe: Any  # (split, result dict, context) -> plain-words failure


def _n(count: int, one: str, many: str) -> str:
    """``_n(1, "row has", "rows have")`` -> "1 row has"; plural otherwise."""
    return f"{count} {one if count == 1 else many}"


def _rows(result: dict[str, Any]) -> list[int]:
    return [int(item["row"]) for item in result.get("unexpected_index_list") or [] if "row" in item]


def _where(rows: Sequence[int], unit: str, filename: str) -> str:
    if not rows:
        return ""
    shown = ", ".join(str(r) for r in rows[:ROWS_IN_MESSAGE])
    more = f" and {len(rows) - ROWS_IN_MESSAGE} more" if len(rows) > ROWS_IN_MESSAGE else ""
    return f" ({unit}{'s' if len(rows) > 1 else ''} {shown}{more} of {filename})"


def build_checks(split: str, cfg: Config, train_prompt_keys: Sequence[str] | None) -> list[Check]:
    import great_expectations.expectations as gxe

    min_rows = cfg.min_rows if split == "train" else 1

    def count(r: dict[str, Any]) -> int:
        return int(r.get("unexpected_count") or 0)

    def nulls(field: str, what: str):  # type: ignore[no-untyped-def]
        return lambda s, r, w: (
            f"{s}: {_n(count(r), 'row has', 'rows have')} no {what} (null){w(_rows(r))}; fill them in or drop those rows"
        )

    def blanks(field: str, what: str):  # type: ignore[no-untyped-def]
        return lambda s, r, w: (
            f"{s}: {_n(count(r), 'row has', 'rows have')} an empty {what}{w(_rows(r))}; write the text or drop those rows"
        )

    def tokens(s: str, r: dict[str, Any], w: Any) -> str:
        items = r.get("unexpected_index_list") or []
        long = [int(i["row"]) for i in items if int(i["n_tokens"]) > cfg.max_tokens]
        short = [int(i["row"]) for i in items if int(i["n_tokens"]) < cfg.min_tokens]
        parts = []
        if long:
            top = max(int(i["n_tokens"]) for i in items)
            parts.append(
                f"{s}: {_n(len(long), 'row has', 'rows have')} more than {cfg.max_tokens} tokens{w(long)}, the longest {top}; "
                "raise max_tokens or shorten them"
            )
        if short:
            parts.append(
                f"{s}: {_n(len(short), 'row has', 'rows have')} fewer than {cfg.min_tokens} tokens{w(short)}; "
                "lower min_tokens or drop them"
            )
        return (
            "; ".join(parts)
            or f"{s}: {_n(count(r), 'row has', 'rows have')} a token length outside [{cfg.min_tokens}, {cfg.max_tokens}]"
        )

    def duplicates(s: str, r: dict[str, Any], w: Any) -> str:
        items = r.get("unexpected_index_list") or []
        pairs = ", ".join(f"{int(i['row'])} = {int(i['duplicate_of'])}" for i in items[:ROWS_IN_MESSAGE])
        more = f" and {len(items) - ROWS_IN_MESSAGE} more" if len(items) > ROWS_IN_MESSAGE else ""
        share = float(r.get("unexpected_percent") or 0.0) / 100
        return (
            f"{s}: {_n(count(r), 'row repeats', 'rows repeat')} an earlier example exactly ({pairs}{more}), a share of {share:.3f} "
            f"> max_duplicate_fraction {cfg.max_duplicate_fraction}; drop the repeats or raise max_duplicate_fraction"
        )

    def row_count(s: str, r: dict[str, Any], w: Any) -> str:
        fix = "add examples or lower min_rows" if s == "train" else "give at least one evaluation example"
        return f"{s}: {r.get('observed_value')} rows, fewer than the {min_rows} required; {fix}"

    def overlap(s: str, r: dict[str, Any], w: Any) -> str:
        sample = next(iter(r.get("partial_unexpected_list") or []), "")
        return (
            f"{s}: {_n(count(r), 'prompt also appears', 'prompts also appear')} in train{w(_rows(r))}, e.g. {str(sample)[:60]!r}; "
            "evaluation on seen prompts flatters the model: remove them from eval (or train)"
        )

    checks = [
        Check(
            f"column {c} present",
            gxe.ExpectColumnToExist(column=c),
            lambda s, r, w, c=c: (
                f"{s}: column {c!r} is missing from the validation frame (an internal error; report it)"
            ),
        )
        for c in ("id", "prompt", "completion", "roles", "n_tokens")
    ]
    checks += [
        Check("row count", gxe.ExpectTableRowCountToBeBetween(min_value=min_rows), row_count),
        Check("prompt not null", gxe.ExpectColumnValuesToNotBeNull(column="prompt"), nulls("prompt", "prompt")),
        Check(
            "completion not null",
            gxe.ExpectColumnValuesToNotBeNull(column="completion"),
            nulls("completion", "completion"),
        ),
        Check(
            "prompt not empty",
            gxe.ExpectColumnValuesToNotMatchRegex(column="prompt", regex=r"^\s*$"),
            blanks("prompt", "prompt"),
        ),
        Check(
            "completion not empty",
            gxe.ExpectColumnValuesToNotMatchRegex(column="completion", regex=r"^\s*$"),
            blanks("completion", "completion"),
        ),
        Check(
            "token length",
            gxe.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=cfg.min_tokens, max_value=cfg.max_tokens),
            tokens,
        ),
        Check(
            "ids unique",
            gxe.ExpectColumnValuesToBeUnique(column="id"),
            lambda s, r, w: (
                f"{s}: {_n(count(r), 'row shares its', 'rows share their')} id with another row{w(_rows(r))}; make ids unique or drop the id column"
            ),
        ),
        Check(
            "no duplicate examples",
            gxe.ExpectColumnValuesToBeNull(column="duplicate_of", mostly=1.0 - cfg.max_duplicate_fraction),
            duplicates,
        ),
        Check(
            "ends with an assistant turn",
            gxe.ExpectColumnValuesToMatchRegex(column="roles", regex=r"^(?:(?:system|user|assistant),)*assistant$"),
            lambda s, r, w: (
                f"{s}: {_n(count(r), 'row does', 'rows do')} not end with an assistant turn{w(_rows(r))}; every example needs its answer last"
            ),
        ),
    ]
    for role in cfg.required_roles:
        checks.append(
            Check(
                f"has a turn with role {role}",
                gxe.ExpectColumnValuesToMatchRegex(column="roles", regex=rf"(?:^|,){role}(?:,|$)"),
                lambda s, r, w, role=role: (
                    f"{s}: {_n(count(r), 'row has', 'rows have')} no {role} turn{w(_rows(r))}; "
                    f"add one or remove {role!r} from required_roles"
                ),
            )
        )
    if train_prompt_keys is not None:
        checks.append(
            Check(
                "no prompt shared with train",
                gxe.ExpectColumnValuesToNotBeInSet(column="prompt_key", value_set=list(train_prompt_keys)),
                overlap,
            )
        )
    return checks


def _gx_context() -> Any:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)  # its INFO lines are noise in task logs
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context


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


def _result_entry(split: str, check: Check, res: Any) -> dict[str, Any]:
    r = res.result or {}
    items = r.get("unexpected_index_list") or []
    entry = {
        "dataset": split,
        "check": check.name,
        "type": res.expectation_config.type,
        "column": res.expectation_config.kwargs.get("column"),
        "success": bool(res.success),
        "unexpected_count": r.get("unexpected_count"),
        "unexpected_percent": r.get("unexpected_percent"),
        "observed_value": r.get("observed_value"),
        "unexpected_examples": items[:EXAMPLES_IN_REPORT],
    }
    if res.exception_info and res.exception_info.get("raised_exception"):
        entry["exception"] = res.exception_info.get("exception_message")
    return _jsonable(entry)


# ------------------------------------------------------------------------------------------ run


def run(ctx: StepContext) -> dict[str, Any]:
    cfg = resolve_config(dict(ctx.config))
    report: dict[str, Any] = {"config": cfg.__dict__ | {"required_roles": list(cfg.required_roles)}}
    report_path = ctx.out / "data_report.json"

    def write_report() -> None:
        report_path.write_text(json.dumps(_jsonable(report), indent=2, sort_keys=True, ensure_ascii=False))

    loaded: dict[str, ds.Dataset] = {}
    load_problems: list[str] = []
    for split in SPLITS:
        if split not in ctx.inputs:
            raise LoraflowError(f"{STAGE}: input {split!r} is missing; give --input {split}=gs://...")
        try:
            path = ds.find_dataset_file(ctx.inputs[split])
            loaded[split] = ds.load(path, id_prefix=f"{split}-")
        except DataValidationError as exc:
            load_problems.append(f"{split}: {exc}")
            continue
        data = loaded[split]
        ctx.progress(f"{split}: {len(data.rows)} rows loaded from {path.name} ({data.format} format)")
    if load_problems:
        report["load_problems"] = load_problems
        report["success"] = False
        write_report()
        raise DataValidationError("the dataset cannot be read:\n" + "\n".join(load_problems))

    counter = TokenCounter(ctx.inputs["tokenizer"])
    report["token_length"] = counter.method
    frames = {split: build_frame(loaded[split], counter) for split in SPLITS}

    started = time.monotonic()
    context = _gx_context()
    gx_import_seconds = time.monotonic() - started
    results: list[tuple[str, Check, Any]] = []
    validate_seconds: dict[str, float] = {}
    for split in SPLITS:
        train_keys = None
        if split == "eval":
            train_keys = sorted({k for k in frames["train"]["prompt_key"] if k})
        checks = build_checks(split, cfg, train_keys)
        t0 = time.monotonic()
        results += [(split, c, r) for c, r in validate(context, split, frames[split], checks)]
        validate_seconds[split] = round(time.monotonic() - t0, 3)
    gx_seconds = time.monotonic() - started

    failures: list[str] = []
    entries = []
    for split, check, res in results:
        entries.append(_result_entry(split, check, res))
        if res.success:
            ctx.progress(f"{split}: {check.name}: ok")
            continue
        data = loaded[split]

        def where(rows: Sequence[int], data: ds.Dataset = data) -> str:
            return _where(rows, data.unit, data.path.name)

        message = check.describe(split, res.result or {}, where)
        failures.append(message)
        ctx.progress(f"{split}: {check.name}: FAILED: {message}")

    stats: dict[str, dict[str, Any]] = {
        split: {
            "rows": len(frames[split]),
            "format": loaded[split].format,
            "file": loaded[split].path.name,
            "tokens_min": int(frames[split]["n_tokens"].min()) if len(frames[split]) else 0,
            "tokens_mean": round(float(frames[split]["n_tokens"].mean()), 2) if len(frames[split]) else 0.0,
            "tokens_max": int(frames[split]["n_tokens"].max()) if len(frames[split]) else 0,
        }
        for split in SPLITS
    }
    max_seen = max(int(s["tokens_max"]) for s in stats.values())
    report |= {
        "success": not failures,
        "failures": failures,
        "expectations": entries,
        "statistics": {
            "evaluated_expectations": len(results),
            "successful_expectations": len(results) - len(failures),
            "unsuccessful_expectations": len(failures),
            "gx_seconds": round(gx_seconds, 3),
            "gx_context_seconds": round(gx_import_seconds, 3),
            "gx_validate_seconds": validate_seconds,
            **stats,
        },
    }
    write_report()
    if failures:
        raise DataValidationError(
            f"{len(failures)} of {len(results)} data expectations failed:\n" + "\n".join(f"  - {f}" for f in failures)
        )

    ds.write_jsonl(loaded["train"].rows, ctx.out / "train.jsonl")
    eval_rows = []
    for row in loaded["eval"].rows:
        prompt, reference = ds.prompt_and_reference(row["messages"])
        eval_rows.append({"id": row["id"], "messages": prompt, "reference": reference})
    ds.write_jsonl(eval_rows, ctx.out / "eval.jsonl")
    ctx.progress(
        f"all {len(results)} expectations passed in {gx_seconds:.2f} s "
        f"({gx_import_seconds:.2f} s of it importing Great Expectations); longest example {max_seen} tokens"
    )
    return {
        "train_rows": stats["train"]["rows"],
        "eval_rows": stats["eval"]["rows"],
        "expectations": len(results),
        "failed": 0,
        "max_tokens_seen": max_seen,
    }


if __name__ == "__main__":
    raise SystemExit(run_step(STAGE, run))
