"""The standard benchmarks inside the evaluate step: lm-evaluation-harness tasks scored by the engine that
scored the eval set (``evaluation.suites``; the rules are :mod:`loraflow.evaluation.suites`').

:class:`EngineLM` is an lm-eval LM over the step's :class:`~loraflow.steps.evaluate.Engine`: the model being
evaluated (the merged model after training), one engine for everything the step scores, the chat template
that rendered the eval set's prompts (lm-eval runs with ``apply_chat_template``, and the wrapper renders
each chat with loraflow's template, as evaluate does), greedy decoding. lm-eval's Jinja environment is
swapped for a sandboxed one while the suites run: a staged task's templates are a spec author's text.

Writes ``suite_samples_<name>.jsonl`` (lm-eval's per-document records, the figures per document);
the step puts each suite's figure in ``metrics.json`` under ``suites``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.data import chat_template
from loraflow.data.chat_template import ChatTemplate
from loraflow.errors import LoraflowError
from loraflow.evaluation import suites
from loraflow.spec.stages import suite_input
from loraflow.spec.step_configs import EvaluateConfig

SAMPLES_FILE = "suite_samples_{name}.jsonl"


@dataclass(frozen=True)
class LoadedSuite:
    """A suite of the config, its task ready for lm-eval: a task name it knows, or a staged task's checked dict."""

    name: str
    task: str
    metric: str
    limit: int | None
    config: dict[str, Any] | None  # None: lm-eval's own task of that name


def load(cfg: EvaluateConfig, inputs: dict[str, Path]) -> list[LoadedSuite]:
    """The config's suites, each staged task read and checked (before any engine is loaded)."""
    loaded = []
    for suite in cfg.suites:
        config = None
        if suite.source is not None:
            folder = inputs.get(suite_input(suite.name))
            if folder is None:
                raise LoraflowError(
                    f"evaluate: suite {suite.name} is staged at {suite.source}, which must come as "
                    f"--input {suite_input(suite.name)}=gs://... (the planner sends it)"
                )
            config = suites.task_config(_task_file(folder, suite.task), suite.task)
        loaded.append(LoadedSuite(suite.name, suite.task, suite.metric, suite.limit, config))
    return loaded


def _task_file(folder: Path, task: str) -> Path:
    found = sorted(folder.rglob(f"{task}.yaml"))
    if len(found) != 1:
        raise LoraflowError(
            f"evaluate: a staged suite folder must hold one {task}.yaml (found {len(found)}); name the file after its task"
        )
    return found[0]


def run(
    engine: Any, cfg: EvaluateConfig, template: ChatTemplate, loaded: list[LoadedSuite], out: Path, progress: Any
) -> dict[str, Any]:
    """Score every suite through :class:`EngineLM`; write their samples; return metrics.json's ``suites``."""
    if all(suite.config is not None for suite in loaded):  # staged tasks read their own files only; a task
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval ships fetches its data from the hub
    import lm_eval

    lm = EngineLM(engine, template, cfg)
    report: dict[str, Any] = {}
    with sandboxed_templates():
        for suite in loaded:
            started = time.monotonic()
            task: Any = suite.config if suite.config is not None else suite.task
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=[task],
                limit=suite.limit,
                apply_chat_template=True,
                log_samples=True,
                random_seed=cfg.seed,
                numpy_random_seed=cfg.seed,
                torch_random_seed=cfg.seed,
                fewshot_random_seed=cfg.seed,
                bootstrap_iters=0,
            )
            if results is None:
                raise LoraflowError(f"evaluate: lm-eval returned no results for suite {suite.name}")
            samples = results["samples"][suite.task]
            entry = suites.suite_result(suite.task, suite.metric, results["results"], samples)
            _write_samples(out / SAMPLES_FILE.format(name=suite.name), samples)
            seconds = time.monotonic() - started
            report[suite.name] = {**entry, "lm_eval_version": lm_eval.__version__, "seconds": round(seconds, 3)}
            progress(f"suite {suite.name} ({suite.task}): {suite.metric} {entry['value']:.4f} over n={entry['n']}")
    return report


def _write_samples(path: Path, samples: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False, default=str) + "\n")


@contextlib.contextmanager
def sandboxed_templates() -> Iterator[None]:
    """lm-eval's Jinja environment (``lm_eval.utils.env``, which renders every task's doc_to_text, doc_to_target
    and doc_to_choice) swapped for a sandboxed one with the same settings and filters, then restored."""
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from lm_eval import utils

    original = utils.env
    sandboxed = ImmutableSandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    sandboxed.filters.update(original.filters)
    utils.env = sandboxed
    try:
        yield
    finally:
        utils.env = original


def _lm_base() -> type:
    from lm_eval.api.model import TemplateLM

    return TemplateLM


class EngineLM(_lm_base()):  # type: ignore[misc]
    """lm-eval's LM over loraflow's engine: lm-eval's requests in, vLLM's answers out (greedy)."""

    def __init__(self, engine: Any, template: ChatTemplate, cfg: EvaluateConfig) -> None:
        super().__init__()
        self.engine = engine
        self.template = template
        self.cfg = cfg
        self.tokenizer = engine.tokenizer

    # -- what lm-eval asks of a model

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def tokenizer_name(self) -> str:
        return f"loraflow-{self.template.digest[:12]}"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered by loraflow's template (the eval set's), as evaluate renders its prompts."""
        if not add_generation_prompt:
            raise suites.SuiteError("a suite's chat must end with the user's turn (gen_prefix is not supported)")
        return chat_template.render(self.template, chat_history, add_generation_prompt=True)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids without added special tokens: the chat template writes them."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from vllm import SamplingParams

        eos = self.tokenizer.decode([self.eot_token_id])
        prompts, params, stops = [], [], []
        for request in requests:
            context, gen_kwargs = request.args
            asked = suites.generation_request(gen_kwargs, eos, self.cfg.max_new_tokens)
            ids = self.tok_encode(context)
            _check_fits(len(ids) + asked.max_tokens, self.cfg.max_model_len)
            prompts.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(temperature=0.0, max_tokens=asked.max_tokens, stop=asked.stop, seed=self.cfg.seed)
            )
            stops.append(asked.stop)
        outputs = self.engine.llm.generate(prompts, params, use_tqdm=False)
        return [suites.cut_at_stops(o.outputs[0].text, stop) for o, stop in zip(outputs, stops, strict=True)]

    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        from vllm import SamplingParams

        sequences = []
        for _, context, continuation in requests:
            _check_fits(len(context) + len(continuation) + 1, self.cfg.max_model_len)
            sequences.append((list(context) + list(continuation), len(context)))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False, seed=self.cfg.seed)
        outputs = self.engine.llm.generate([{"prompt_token_ids": ids} for ids, _ in sequences], params, use_tqdm=False)
        return [
            suites.continuation_score(_as_floats(o.prompt_logprobs), ids, start)
            for o, (ids, start) in zip(outputs, sequences, strict=True)
        ]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise suites.SuiteError("perplexity tasks (loglikelihood_rolling) are not scored by loraflow's suites")


def _as_floats(prompt_logprobs: Any) -> list[dict[int, float] | None]:
    return [None if at is None else {t: float(lp.logprob) for t, lp in at.items()} for at in prompt_logprobs or []]


def _check_fits(tokens: int, max_model_len: int) -> None:
    if tokens > max_model_len:
        raise suites.SuiteError(
            f"a suite request needs {tokens} tokens, more than evaluation.max_model_len={max_model_len}: "
            "raise max_model_len or lower the task's max_gen_toks"
        )
