"""Training sees exactly the prompt token ids evaluation sends, and learns only the answers.

lora_sft's MaxText command line (``loraflow.trainer.argv.sft_argv``) drives MaxText's own SFT data pipeline
(``create_data_iterator``: the HF dataset, MaxText's chat template step, tokenization and prompt
masking); each example's batch is compared with the ids the evaluation path renders for the same row
(``loraflow.evaluation.examples.render_prompts``, as evaluate and the QLoRA answers call it), for
prompt/completion and chat rows, with and without a system turn, multi-turn, under a template the
test adds to the tiny tokenizer (ChatML with a default system turn), the tiny model's own and none,
and the tiny Gemma 3's own (Gemma's template, its turn markers single special tokens), also with a
tokenizer that adds its BOS by default as real Gemma 3 and Llama 3 tokenizers do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loraflow.data import chat_template as ct
from loraflow.data import dataset as ds
from loraflow.dev import tinymodel
from loraflow.evaluation.examples import Example, render_prompts
from tests import chat_cases
from tests.chat_cases import CHATML

PARITY = Path(__file__).resolve().parents[2] / "pipelines" / "data" / "parity"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's checkpoint, its tokenizer given a second, named template (ChatML)."""
    hf = tinymodel.create(tmp_path_factory.mktemp("tiny") / "hf", [PARITY / "train.jsonl"])
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": cfg["chat_template"]},
        {"name": "chatml", "template": CHATML},
    ]
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    return hf


@pytest.fixture(scope="module")
def gemma3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3's checkpoint: Gemma's chat template and turn tokens."""
    return tinymodel.create(tmp_path_factory.mktemp("tiny-gemma3") / "hf", [PARITY / "train.jsonl"], family="gemma3")


@pytest.fixture(scope="module")
def gemma3_bos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3's tokenizer adding its BOS to every text it encodes by default, as a real Gemma 3's
    (and Llama 3's) does: a post-processor writes it, and add_bos_token is on. The template writes the BOS
    too: training must not see it twice."""
    hf = tinymodel.create(tmp_path_factory.mktemp("tiny-gemma3-bos") / "hf", [PARITY / "train.jsonl"], family="gemma3")
    bos = tinymodel.GEMMA3_CHAT.bos
    first = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    second = [{"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}]
    tokenizer = json.loads((hf / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": first,
        "pair": first + second,
        "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}},
    }
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))
    cfg = json.loads((hf / "tokenizer_config.json").read_text()) | {"add_bos_token": True}
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    return hf


def _rows() -> list[dict[str, Any]]:
    return [chat_cases.normalised(r) for r in chat_cases.RECORDS]


def _maxtext_batches(tokenizer: Path, dataset: Path, tmp: Path, n: int) -> list[dict[str, np.ndarray]]:
    """The first ``n`` batches (one example each, unpacked, in file order) of MaxText's SFT data pipeline."""
    from absl import flags
    from maxtext.configs import pyconfig
    from maxtext.input_pipeline import input_pipeline_interface
    from maxtext.utils import maxtext_utils

    from loraflow.spec.step_configs import LoraSftConfig, parse
    from loraflow.trainer.argv import sft_argv
    from loraflow.trainer.converted import ConvertedModel
    from loraflow.trainer.data import TrainingSet, prepare

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    settings = {"steps": 1, "batch_size": 1, "max_length": 512, "dtype": "float32", "packing": False, "shuffle": False}
    cfg = parse(LoraSftConfig, {**settings, "hardware": "cpu"})
    model = ConvertedModel(tinymodel.MAXTEXT_MODEL, dict(tinymodel.MAXTEXT_OVERRIDES), True, "/nowhere")
    data = prepare(cfg, TrainingSet(dataset / "train.jsonl", n), tokenizer)
    argv = sft_argv(cfg, model, data, tokenizer, str(tmp / "maxtext"))
    mt_config = pyconfig.initialize_pydantic(argv)
    assert mt_config.sft_train_on_completion_only and mt_config.use_sft
    iterator, _ = input_pipeline_interface.create_data_iterator(
        mt_config, maxtext_utils.get_mesh_from_config(mt_config)
    )
    return [{k: np.asarray(v)[0] for k, v in next(iterator).items()} for _ in range(n)]


@pytest.mark.parametrize(
    ("family", "setting"),
    [("llama", "tokenizer:chatml"), ("llama", "auto"), ("llama", "none"), ("gemma3", "auto"), ("gemma3_bos", "auto")],
)
def test_training_inputs_begin_with_the_eval_prompt_ids_and_only_answers_are_learned(
    request: pytest.FixtureRequest, tmp_path: Path, family: str, setting: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = request.getfixturevalue("tokenizer" if family == "llama" else f"{family}_tokenizer")
    if family == "gemma3_bos":
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(str(tokenizer))("odd")["input_ids"][0] == 1  # adds its BOS by default
    template = ct.resolve(setting, tokenizer)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    rows = _rows()
    ds.write_jsonl(rows, dataset / "train.jsonl")
    ct.write_record(template, dataset)  # as validate_data hands it on
    batches = _maxtext_batches(tokenizer, dataset, tmp_path, len(rows))
    hf_tok = AutoTokenizer.from_pretrained(str(tokenizer))

    for row, batch in zip(rows, batches, strict=True):
        messages = row["messages"]
        length = int((batch["inputs_segmentation"] > 0).sum())
        inputs = batch["inputs"][:length].tolist()
        learned = batch["targets_segmentation"][:length] > 0
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        expected_learned = np.zeros(length, dtype=bool)
        for turn in answers:
            # What evaluation sends for this turn: the turns before it, with the generation prompt.
            _, (prompt_ids,) = render_prompts(hf_tok, [Example(row["id"], messages[:turn], "")], template)
            assert inputs[: len(prompt_ids)] == prompt_ids, (setting, row["id"], turn)
            answer = hf_tok(messages[turn]["content"], add_special_tokens=False)["input_ids"]
            assert inputs[len(prompt_ids) : len(prompt_ids) + len(answer)] == answer
            end = len(prompt_ids) + len(answer)
            while end < length and not _through_answer(template, inputs[:end], hf_tok, messages, turn):
                end += 1
            # The target at position p is the token at p + 1: the answer's tokens, through its end.
            expected_learned[len(prompt_ids) - 1 : end - 1] = True
        assert learned.tolist() == expected_learned.tolist(), (setting, row["id"])
        full_text = ct.render(template, messages, add_generation_prompt=False)
        assert hf_tok.decode(inputs, skip_special_tokens=False) == full_text


def _through_answer(template: ct.ChatTemplate, ids: list[int], tok: Any, messages: list[dict], turn: int) -> bool:
    """Whether ``ids`` decode to the conversation through answer ``turn`` (its end marker included)."""
    return bool(tok.decode(ids, skip_special_tokens=False) == ct.render(template, messages[: turn + 1], False))
