"""QLoRA's own answers (lora_sft, quantized base + adapter) end where vLLM's do: at the tokenizer's EOS
and at every end token the checkpoint's generation_config.json lists (an instruct model's end of turn)."""

from __future__ import annotations

import json
from pathlib import Path

from loraflow.trainer.answers import stop_ids


def test_an_answer_stops_at_every_end_token_the_checkpoint_lists(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert stop_ids(tmp_path, 1) == {1, 106}  # Gemma's <eos> and <end_of_turn>


def test_a_single_end_token_or_none_listed(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_ids(tmp_path, 2) == {2, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert stop_ids(tmp_path, 2) == {2}
    (tmp_path / "generation_config.json").unlink()
    assert stop_ids(tmp_path, 2) == {2}
    assert stop_ids(tmp_path, None) == frozenset()
