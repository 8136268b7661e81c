"""What merging a QLoRA adapter into the full-precision base costs, measured on the same examples.

The model that trained under QLoRA is the quantized base plus the adapter; the model loraflow
merges, evaluates and publishes is the full-precision base plus the same adapter. lora_sft answers
the first eval examples with the first (``quantized_answers.jsonl``: id, output); evaluate_tuned
answers the whole eval set with the second (``predictions.jsonl`` with each example's reference and
per-metric outcomes, ``metrics.json`` with its scoring settings). This scores the trainer's answers
with evaluate_tuned's own settings and puts each metric side by side over the examples both answered.
Pure: plain rows in, plain numbers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loraflow.evaluation import metrics as metric_table


def compare(
    quantized: Sequence[Mapping[str, Any]], merged: Sequence[Mapping[str, Any]], settings: metric_table.Scoring
) -> dict[str, Any] | None:
    """Per metric, the quantized model's rate, the merged model's and ``change`` (merged - quantized), over the
    examples both answered (``n``); None when they share none. ``settings``: evaluate_tuned's, as its
    metrics.json records them (``metric_table.Scoring.recorded``)."""
    by_id = {str(row["id"]): row for row in merged}
    pairs = [(row, by_id[str(row["id"])]) for row in quantized if str(row["id"]) in by_id]
    if not pairs:
        return None
    scored = [metric_table.score(str(q["output"]), str(m["reference"]), settings) for q, m in pairs]
    rows = []
    for metric in settings.chosen:
        trained = sum(s.outcomes[metric.column] for s in scored) / len(pairs)
        merged_rate = sum(bool(m.get(metric.column)) for _, m in pairs) / len(pairs)
        rows.append(
            {"metric": metric.name, "quantized": trained, "merged": merged_rate, "change": merged_rate - trained}
        )
    same = sum(str(q["output"]).strip() == str(m.get("generation", "")).strip() for q, m in pairs)
    return {"n": len(pairs), "metrics": rows, "identical_outputs": same}
