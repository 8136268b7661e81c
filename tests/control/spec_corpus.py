"""Malformed pipeline specs: each entry is (id, edits, key path the error must name, words it must say).

Edits apply to the tiny spec: ``{"a.b": value}`` sets a key, ``{"a.b": DELETE}`` removes it.
"""

from __future__ import annotations

from typing import Any

DELETE = object()

CORPUS: list[tuple[str, dict[str, Any], str, str]] = [
    ("steps-not-a-number", {"training.steps": "many"}, "training.steps", "valid integer"),
    ("steps-zero", {"training.steps": 0}, "training.steps", "greater than or equal to 1"),
    ("steps-float", {"training.steps": 1.5}, "training.steps", "valid integer"),
    ("rank-zero", {"lora.rank": 0}, "lora.rank", "greater than or equal to 1"),
    ("rank-huge", {"lora.rank": 100000}, "lora.rank", "less than or equal to 1024"),
    ("alpha-negative", {"lora.alpha": -1}, "lora.alpha", "greater than 0"),
    ("lr-above-one", {"training.learning_rate": 3}, "training.learning_rate", "less than 1"),
    ("lr-zero", {"training.learning_rate": 0}, "training.learning_rate", "greater than 0"),
    ("batch-zero", {"training.batch_size": 0}, "training.batch_size", "greater than or equal to 1"),
    ("max-length-tiny", {"training.max_length": 2}, "training.max_length", "greater than or equal to 8"),
    ("dtype-unknown", {"training.dtype": "float16"}, "training.dtype", "'float32' or 'bfloat16'"),
    ("unknown-top-key", {"trainning": {"steps": 1}}, "trainning", "unknown key"),
    ("unknown-nested-key", {"lora.dropout": 0.1}, "lora.dropout", "unknown key"),
    ("missing-name", {"name": DELETE}, "name", "required"),
    ("missing-base-model", {"base_model": DELETE}, "base_model", "required"),
    ("missing-train-data", {"data.train": DELETE}, "data.train", "required"),
    ("missing-artifact-root", {"artifact_root": DELETE}, "artifact_root", "required"),
    ("local-path-dataset", {"data.train": "/home/me/train.jsonl"}, "data.train", "gs://BUCKET/PATH"),
    ("s3-dataset", {"data.eval": "s3://bucket/eval.jsonl"}, "data.eval", "gs://BUCKET/PATH"),
    ("http-checkpoint", {"base_model.hf_checkpoint": "https://hub/model"}, "base_model.hf_checkpoint", "gs://"),
    ("bucketless-uri", {"artifact_root": "gs:///x"}, "artifact_root", "gs://BUCKET/PATH"),
    ("parent-escape", {"artifact_root": "gs://bucket/runs/../../other"}, "artifact_root", "'..'"),
    ("bad-name", {"name": "Tiny LLama!"}, "name", "lowercase letters"),
    ("bad-cron", {"schedule": "every monday"}, "schedule", "five fields"),
    ("bad-asset", {"schedule": {"asset": "/data/ready"}}, "schedule", "gs://"),
    ("asset-extra-key", {"schedule": {"asset": "gs://b/x", "when": "now"}}, "schedule", "{asset: gs://BUCKET/PATH}"),
    ("bad-regex", {"evaluation.answer_pattern": "([a-z"}, "evaluation.answer_pattern", "regular expression"),
    ("regex-no-group", {"evaluation.answer_pattern": "even|odd"}, "evaluation.answer_pattern", "capturing group"),
    ("unknown-stage-compute", {"compute.train": {"launcher": "local"}}, "compute", "unknown stage"),
    (
        "unknown-launcher",
        {"compute.lora_sft": {"launcher": "slurm"}},
        "compute.lora_sft.launcher",
        "'local', 'vertex' or 'gke'",
    ),
    (
        "vertex-without-image",
        {"compute.lora_sft": {"launcher": "vertex", "machine_type": "ct5lp-hightpu-4t"}},
        "compute.lora_sft",
        "needs image",
    ),
    ("multi-host-local", {"compute.lora_sft": {"launcher": "local", "hosts": 4}}, "compute.lora_sft", "hosts: 1"),
    (
        "hosts-zero",
        {"compute.lora_sft": {"launcher": "vertex", "image": "i", "machine_type": "m", "hosts": 0}},
        "compute.lora_sft.hosts",
        "greater than or equal to 1",
    ),
    (
        "param-unknown-path",
        {"params": [{"path": "training.epochs"}]},
        "(top level)",
        "training.epochs is not a setting",
    ),
    ("param-section", {"params": [{"path": "training"}]}, "(top level)", "is a section"),
    ("param-forbidden", {"params": [{"path": "artifact_root"}]}, "(top level)", "cannot be overridden"),
    ("param-twice", {"params": [{"path": "lora.rank"}, {"path": "lora.rank"}]}, "(top level)", "listed twice"),
    ("gate-confidence", {"gate.confidence": 1.5}, "gate.confidence", "less than 1"),
    ("gate-metric", {"gate.metric": "bleu"}, "gate.metric", "use one of: accuracy, format_rate"),
    (
        "min-rows-zero",
        {"data.expectations.row_count.min": 0},
        "data.expectations.row_count.min",
        "greater than or equal to 1",
    ),
    (
        "duplicate-fraction",
        {"data.expectations.duplicates.max_fraction": 2},
        "data.expectations.duplicates.max_fraction",
        "less than or equal to 1",
    ),
    (
        "expectation-level",
        {"data.expectations.leakage.level": "error"},
        "data.expectations.leakage.level",
        "'fail' or 'warn'",
    ),
    (
        "unknown-expectation",
        {"data.expectations.no_profanity": {"level": "warn"}},
        "data.expectations.no_profanity",
        "unknown key",
    ),
    ("token-bounds-crossed", {"data.expectations.token_length.min": 64}, "data.expectations.token_length", "above max"),
    ("data-key-moved", {"data.min_rows": 1000}, "data", "data.min_rows moved: write data.expectations.row_count.min"),
    (
        "vertex-registry-no-image",
        {"publish.vertex_model_registry.project": "p"},
        "publish.vertex_model_registry.serving_container_image",
        "required",
    ),
    (
        "vertex-registry-bad-label",
        {"publish.vertex_model_registry.labels": {"Team": "a b"}},
        "publish.vertex_model_registry.labels",
        "not Vertex AI labels",
    ),
    (
        "overrides-not-scalars",
        {"base_model.model_overrides": {"base_emb_dim": [1, 2]}},
        "base_model.model_overrides.base_emb_dim",
        "",
    ),
    ("lora-not-a-mapping", {"lora": "rank 16"}, "lora", "valid dictionary"),
    # Jinja folds constants while compiling: these held `loraflow validate` and the DAG processor for ever
    ("template-power-bomb", {"data.chat_template": "{{ 9 ** (9 ** 9) }}"}, "data.chat_template", "4096 bits"),
    ("template-memory-bomb", {"data.chat_template": "{{ 'x' * 2**34 }}"}, "data.chat_template", "repetition"),
]


def apply(data: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    for path, value in edits.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return data
