"""Fixtures for the control environment's tests: step contexts on local directories, a tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import hypothesis
import pytest

from loraflow.steps._harness import StepContext

# Property tests assert what holds, never how fast: hypothesis's default 200 ms deadline per example
# failed on a loaded 2-core machine (a slow first example is no bug), so there is none.
hypothesis.settings.register_profile("loraflow", deadline=None)
hypothesis.settings.load_profile("loraflow")

REPO = Path(__file__).resolve().parents[2]
PARITY = REPO / "pipelines" / "data" / "parity"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json + tokenizer_config.json (with the chat template) as loraflow.dev.tinymodel makes them.

    Built here with the tokenizers library alone: the full tiny checkpoint needs safetensors,
    which the control environment does not have.
    """
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"), PARITY / "train.jsonl")


def write_tokenizer(out: Path, corpus: Path, numbers: str = "digits") -> Path:
    """The tiny model's tokenizer trained on ``corpus`` (as ``tinymodel.create --corpus --numbers`` trains it)
    in ``out``."""
    from loraflow.dev import tinymodel

    tok = tinymodel._tokenizer(list(tinymodel._corpus_lines([corpus])), tinymodel.DIMS["vocab_size"], numbers)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|end|>",
        "pad_token": "<|pad|>",
        "chat_template": tinymodel.CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def task_inputs(folder: Path, data: Path, tokenizer: Path) -> dict[str, Path]:
    """validate_data's inputs: a task's train.jsonl and eval.jsonl (from ``data``) in their own folders."""
    inputs = {"train": folder / "train", "eval": folder / "eval", "tokenizer": tokenizer}
    for split in ("train", "eval"):
        inputs[split].mkdir()
        shutil.copy(data / f"{split}.jsonl", inputs[split])
    return inputs


@pytest.fixture
def make_ctx(tmp_path: Path) -> Callable[..., StepContext]:
    """StepContext(stage, inputs={name: local dir}, config) with fresh out/ and work/ dirs."""

    def make(
        stage: str, inputs: dict[str, Path], config: dict | None = None, manifests: dict | None = None
    ) -> StepContext:
        root = tmp_path / f"ctx-{stage}"
        shutil.rmtree(root, ignore_errors=True)
        (root / "out").mkdir(parents=True)
        (root / "work").mkdir()
        return StepContext(
            stage,
            f"gs://test/{stage}",
            dict(inputs),
            dict(manifests or {}),
            root / "out",
            root / "work",
            dict(config or {}),
        )

    return make


@pytest.fixture
def parity_spec(gcs_bucket: str, tokenizer_dir: Path):
    """The tiny spec pointed at a fresh GCS prefix holding the parity data and a tokenizer."""
    from loraflow.spec.schema import load_spec, with_overrides
    from loraflow.storage import gcs

    bucket_name, base = gcs.split_uri(gcs_bucket)
    bucket = gcs.client().bucket(bucket_name)
    for name in ("train.jsonl", "eval.jsonl"):
        bucket.blob(f"{base}/data/{name}").upload_from_filename(str(PARITY / name))
    for path in tokenizer_dir.iterdir():
        bucket.blob(f"{base}/model/{path.name}").upload_from_filename(str(path))
    spec = load_spec(REPO / "pipelines" / "tiny-llama-lora.yaml")
    data = spec.data.model_copy(
        update={"train": f"{gcs_bucket}/data/train.jsonl", "eval": f"{gcs_bucket}/data/eval.jsonl"}
    )
    model = spec.base_model.model_copy(update={"tokenizer": f"{gcs_bucket}/model"})
    spec = spec.model_copy(update={"artifact_root": f"{gcs_bucket}/artifacts", "data": data, "base_model": model})
    return with_overrides(spec, {})


@pytest.fixture
def strict_gcs_bucket(gcs_bucket: str) -> str:
    """A fresh ``gs://`` prefix for a test whose point is a GCS precondition: the session's emulator
    (fake-gcs-server, loraflow/dev/local_gcs.py) enforces them as GCS does, so this is ``gcs_bucket`` by
    a name that says what the test relies on."""
    return gcs_bucket
