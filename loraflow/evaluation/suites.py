"""Standard benchmarks (``evaluation.suites``): lm-evaluation-harness tasks scored in the evaluate step's engine.

A suite names an lm-eval task: one lm-eval ships (``gsm8k``: its data comes from the Hugging Face hub,
so the serving host needs network) or one defined by a task YAML staged in GCS (``source``: a folder
holding ``<task>.yaml`` and its data files; nothing is fetched at run time). The evaluate step scores each
suite through :mod:`loraflow.steps._suites`, an lm-eval LM wrapping the engine that scored the eval set.

This module is what needs no lm-eval and no vLLM (the spec's rules, the control env's tests, mutation):

* :func:`task_config`: a staged task YAML, read bounded and confined. A spec may be hostile, and lm-eval's
  own YAML loader imports Python for a ``!function`` tag: this loader knows no tags at all, so a task with
  code is refused, as is an ``include`` (the task must be one file), a dataset that is not local files of
  its folder (``dataset_path`` json, csv or parquet with ``dataset_kwargs.data_files`` named relative to
  the folder), and an output type the wrapper does not score.
* :func:`generation_request` and :func:`continuation_score`: the wrapper's translation of lm-eval's
  requests into vLLM's terms and of vLLM's log-probabilities back.
* :func:`suite_result`: one suite's figure and per-document values from lm-eval's results and samples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from loraflow.errors import LoraflowError

#: A suite's name: its key in metrics.json, the report and ``gate.guard.suite``.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
#: lm-eval's task names (``gsm8k``, ``mmlu_abstract_algebra``, ``arc_easy``, ...).
TASK_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")
#: lm-eval's result key: ``metric,filter`` (``exact_match,strict-match``, ``acc,none``).
METRIC_PATTERN = re.compile(r"^[A-Za-z0-9_]{1,64},[A-Za-z0-9_\-]{1,64}$")

#: The largest task YAML read (lm-eval's own are 1-3 KB), and how deep its nesting may go.
MAX_TASK_BYTES = 256 << 10
MAX_TASK_DEPTH = 16
#: Loaders lm-eval hands to ``datasets.load_dataset`` for local files.
LOCAL_LOADERS = ("json", "csv", "parquet")
#: The request types the wrapper scores (``loglikelihood_rolling``: perplexity tasks, is not one).
OUTPUT_TYPES = ("generate_until", "multiple_choice", "loglikelihood")
#: Task keys that would run code, read outside the folder or change how the chat is built.
REFUSED_KEYS = {
    "include": "a task must be one file: copy what it includes into it",
    "custom_dataset": "it is Python: give the data as json, csv or parquet files beside the YAML",
    "gen_prefix": "an assistant prefill is not rendered by loraflow's chat template: put the text in doc_to_text",
    "unsafe_code": "loraflow runs no code from a spec",
}
#: Generation settings a task may give; loraflow scores suites greedily, as the eval set.
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature")


class SuiteError(LoraflowError):
    """A suite's task or results cannot be used (a refused task YAML, a metric the task does not report)."""


def check_name(value: str) -> str:
    if not NAME_PATTERN.match(value):
        raise ValueError(f"{value!r} is not a suite name: lowercase letters, digits and _, starting with a letter")
    return value


def check_task(value: str) -> str:
    if not TASK_PATTERN.match(value):
        raise ValueError(f"{value!r} is not an lm-eval task name (letters, digits, _ . -)")
    return value


def check_metric(value: str) -> str:
    if not METRIC_PATTERN.match(value):
        raise ValueError(
            f"{value!r} is not an lm-eval result key: write METRIC,FILTER as lm-eval reports it "
            "(exact_match,strict-match; acc,none)"
        )
    return value


# ------------------------------------------------------------------------------------ task YAML


def task_config(path: Path, task: str) -> dict[str, Any]:
    """The task YAML at ``path`` (staged beside its data), read bounded and checked, its data files made
    absolute paths inside its folder: the dict lm-eval is handed instead of the file."""
    where = f"suite task {path.name}"
    with path.open("rb") as f:
        data = f.read(MAX_TASK_BYTES + 1)  # no more than one byte past the bound is read
    if len(data) > MAX_TASK_BYTES:
        raise SuiteError(f"{where} is larger than {MAX_TASK_BYTES >> 10} KiB; a task YAML is a few KB")
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise SuiteError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    config = _parse_yaml(text, where)
    _check_depth(config, where, 0)
    if config.get("task") != task:
        raise SuiteError(f"{where} defines task {config.get('task')!r}, not {task!r}: name the file after its task")
    for key, why in REFUSED_KEYS.items():
        if key in config:
            raise SuiteError(f"{where}: {key!r} is refused ({why})")
    if config.get("output_type") not in OUTPUT_TYPES:
        raise SuiteError(
            f"{where}: output_type {config.get('output_type')!r} is not scored by loraflow; use one of: "
            + ", ".join(OUTPUT_TYPES)
        )
    config["dataset_kwargs"] = {"data_files": _data_files(config, path.parent, where)}
    return config


def _parse_yaml(text: str, where: str) -> dict[str, Any]:
    import yaml

    try:
        config = yaml.safe_load(text)  # no tags: lm-eval's '!function' is a constructor error here
    except yaml.constructor.ConstructorError as exc:
        tag = getattr(exc, "problem", "")
        raise SuiteError(
            f"{where} uses a YAML tag ({tag}); '!function' imports Python and loraflow runs no code from a spec: "
            "write the step as a Jinja template or a filter in the YAML"
        ) from None
    except yaml.YAMLError as exc:
        raise SuiteError(f"{where} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise SuiteError(f"{where} is not a task (a mapping of lm-eval's task keys)")
    return config


def _check_depth(value: Any, where: str, depth: int) -> None:
    if depth > MAX_TASK_DEPTH:
        raise SuiteError(f"{where} nests deeper than {MAX_TASK_DEPTH} levels")
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        _check_depth(child, where, depth + 1)


def _data_files(config: Mapping[str, Any], folder: Path, where: str) -> dict[str, list[str]]:
    """``dataset_kwargs.data_files`` ({split: file or files}) as absolute paths of files in ``folder``."""
    if config.get("dataset_path") not in LOCAL_LOADERS or config.get("dataset_name") is not None:
        raise SuiteError(
            f"{where}: dataset_path must be one of {', '.join(LOCAL_LOADERS)} (files staged beside the YAML; "
            f"nothing is downloaded at run time), not {config.get('dataset_path')!r}"
        )
    kwargs = config.get("dataset_kwargs")
    extra = sorted(set(kwargs) - {"data_files"}) if isinstance(kwargs, dict) else []
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if extra or not isinstance(files, dict) or not files:
        raise SuiteError(f"{where}: dataset_kwargs must be {{data_files: {{SPLIT: FILE}}}} only (got {kwargs!r})")
    return {str(split): [_local_file(name, folder, where) for name in _names(value)] for split, value in files.items()}


def _names(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _local_file(name: Any, folder: Path, where: str) -> str:
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name.startswith("/") or ".." in parts or "\\" in name:
        raise SuiteError(f"{where}: data file {name!r} must be a path relative to the task's folder, without '..'")
    path = folder.joinpath(*parts)
    if not path.is_file():
        raise SuiteError(f"{where}: data file {name!r} is not staged beside the task YAML")
    return str(path)


# ------------------------------------------------------------------------------------ request translation


@dataclass(frozen=True)
class GenerationRequest:
    """One lm-eval ``generate_until`` request's settings in vLLM's terms (always greedy)."""

    stop: list[str]
    max_tokens: int


def generation_request(gen_kwargs: Mapping[str, Any], eos: str, default_max_tokens: int) -> GenerationRequest:
    """lm-eval's ``generation_kwargs`` as vLLM stop strings and a token budget: ``until`` (a string or a list)
    plus the tokenizer's end-of-sequence text, ``max_gen_toks`` or the evaluation's ``max_new_tokens``."""
    unknown = sorted(set(gen_kwargs) - set(GENERATION_KEYS))
    if unknown:
        raise SuiteError(f"generation_kwargs {unknown} are not supported; a suite may set {', '.join(GENERATION_KEYS)}")
    if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) > 0.0:
        raise SuiteError("a suite is scored greedily, as the eval set: set do_sample: false and temperature: 0")
    until = gen_kwargs.get("until") or []
    stop = [until] if isinstance(until, str) else list(until)
    if not all(isinstance(s, str) and s for s in stop):
        raise SuiteError(f"generation_kwargs.until must be strings (got {until!r})")
    if eos and eos not in stop:
        stop.append(eos)
    max_tokens = int(gen_kwargs.get("max_gen_toks") or default_max_tokens)
    if max_tokens < 1:
        raise SuiteError(f"generation_kwargs.max_gen_toks must be at least 1 (got {max_tokens})")
    return GenerationRequest(stop, max_tokens)


def cut_at_stops(text: str, stop: Sequence[str]) -> str:
    """The text up to the first of the stop strings (vLLM stops there already; a stop that is split over
    tokens may still show)."""
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text = text[:at]
    return text


def continuation_score(
    logprobs: Sequence[Mapping[int, float] | None], tokens: Sequence[int], context_len: int
) -> tuple[float, bool]:
    """lm-eval's answer to a log-likelihood request: the summed log-probability of the continuation (the
    tokens from ``context_len`` on) and whether each of its tokens was the most likely one there.

    ``logprobs[k]``: token id -> log-probability at position k (vLLM's ``prompt_logprobs``, holding the
    token itself and the top one)."""
    if len(logprobs) != len(tokens) or not 0 < context_len <= len(tokens):
        raise SuiteError(
            f"vLLM returned {len(logprobs)} prompt log-probabilities for {len(tokens)} tokens "
            f"(continuation from {context_len})"
        )
    total, greedy = 0.0, True
    for k in range(context_len, len(tokens)):
        at = logprobs[k] or {}
        total += at[tokens[k]]
        greedy = greedy and max(at, key=lambda t: at[t]) == tokens[k]
    return total, greedy


# ------------------------------------------------------------------------------------ results


def suite_result(
    task: str, metric: str, results: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One suite's entry of metrics.json: lm-eval's figure for ``metric`` (``METRIC,FILTER``), its standard
    error, and each document's value (ids: lm-eval's ``doc_id``), for the gate's paired comparison."""
    figures = results.get(task) or {}
    if metric not in figures:
        reported = sorted(k for k in figures if "," in k and "_stderr" not in k)
        raise SuiteError(f"suite task {task} reports no {metric!r}; it reports: {', '.join(reported) or 'nothing'}")
    name, _, filter_name = metric.partition(",")
    per_doc = {str(s["doc_id"]): float(s[name]) for s in samples if s.get("filter") == filter_name and name in s}
    ids = sorted(per_doc, key=int)
    stderr = figures.get(f"{name}_stderr,{filter_name}")
    return {
        "task": task,
        "metric": metric,
        "value": float(figures[metric]),
        "stderr": float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None,
        "n": len(ids),
        "ids": ids,
        "values": [per_doc[i] for i in ids],
    }


def outcomes(entry: Mapping[str, Any], where: str) -> dict[str, bool]:
    """A suite's per-document values as right/wrong, for the guard's paired comparison: each must be 0 or 1."""
    ids, values = entry.get("ids"), entry.get("values")
    if not isinstance(ids, list) or not isinstance(values, list) or len(ids) != len(values):
        raise SuiteError(f"{where}: the suite's ids and values are missing or of different lengths")
    if any(v not in (0, 1) for v in values):
        raise SuiteError(
            f"{where}: metric {entry.get('metric')} is not right/wrong per document (values other than 0 and 1); "
            "a guard needs such a metric (exact_match, acc)"
        )
    return {str(i): bool(v) for i, v in zip(ids, values, strict=True)}
