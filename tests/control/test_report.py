"""The run report: rendering from constructed data, and the report step on committed artifacts."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.pipeline.plan import REPORTED
from loraflow.reporting import report, urls
from loraflow.steps import report as report_step
from loraflow.storage import artifacts, gcs

SECTIONS = ["verdict", "metrics", "gate", "training", "data", "samples", "stages"]


class Page(HTMLParser):
    """Collects section ids and every src/href of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.refs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name == "id" and value:
                self.ids.append(value)
            if name in ("src", "href") and value is not None:
                self.refs.append(value)


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    return p


def prediction(i: int, correct: bool, generation: str) -> dict[str, Any]:
    return {
        "id": f"eval-{i:06d}",
        "prompt": f"<|user|>Is {i} even or odd? <script>alert(1)</script>",
        "reference": "even" if i % 2 == 0 else "odd",
        "generation": generation,
        "correct": correct,
    }


BASE = [prediction(i, i < 2, "even" if i < 2 else "banana") for i in range(10)]
TUNED = [prediction(i, i != 1, "even" if i != 1 else "odd") for i in range(10)]
DECISION = {
    "promote": True,
    "metric": "accuracy",
    "n": 10,
    "base": 0.2,
    "tuned": 0.9,
    "delta": 0.7,
    "ci": [0.4, 0.9],
    "confidence": 0.95,
    "min_improvement": 0.3,
    "fixed": 8,
    "broken": 1,
    "bootstrap_samples": 2000,
    "seed": 0,
    "reason": "accuracy rose by +0.700 (0.200 -> 0.900) >= +0.300",
    "rule": "promote iff ...",
    "identical_generations": 1,
    "champion": {"version": 1, "run_id": "run-0", "metric": "accuracy", "value": 0.5, "verdict": "beats it"},
    "notes": ["a note"],
}
DATA_REPORT = {
    "success": True,
    "failures": [],
    "expectations": [
        {"dataset": "train", "check": "no empty completion", "type": "expect_x", "success": True},
        {"dataset": "eval", "check": "no leakage", "type": "expect_y", "success": True, "unexpected_count": 0},
    ],
    "statistics": {
        "evaluated_expectations": 2,
        "successful_expectations": 2,
        "train": {"rows": 2000, "format": "prompt_completion", "file": "train.jsonl", "tokens_min": 16},
        "eval": {"rows": 10, "format": "prompt_completion", "file": "eval.jsonl", "tokens_min": 16},
    },
}
LOSS = "step,loss,tokens_per_s\n" + "".join(f"{s},{6 / s:.4f},1000\n" for s in range(1, 51))


def constructed() -> dict[str, Any]:
    return {
        "pipeline": "tiny",
        "run_id": "run-2",
        "run_prefix": "gs://b/arts/tiny/run-2",
        "generated_at": "now",
        "stages": [
            {"stage": "validate_data", "status": "ran", "seconds": 12.5, "manifest": "gs://b/x/_MANIFEST.json"},
            {"stage": "lora_sft", "status": "reused", "from_run": "run-1", "seconds": 80.0, "manifest": "gs://b/y"},
            {"stage": "publish", "status": "not run"},
        ],
        "loss": [(float(s), 6 / s, 1000.0) for s in range(1, 51)],
        "training_summary": {"steps": 50, "final_loss": 0.12},
        "base_metrics": {"accuracy": 0.2, "format_rate": 0.5, "n": 10},
        "tuned_metrics": {"accuracy": 0.9, "format_rate": 1.0, "n": 10},
        "decision": DECISION,
        "data_report": DATA_REPORT,
        "samples": report.sample_outputs(BASE, TUNED),
        "publish": {"promoted": True, "version": 2, "alias": "champion", "version_uri": "gs://b/_registry/v2"},
    }


def test_report_has_every_section_and_is_self_contained() -> None:
    page = report.render(constructed())
    parsed = parse(page)
    assert set(SECTIONS) <= set(parsed.ids)
    assert not [r for r in parsed.refs if re.match(r"\s*(https?:)?//", r)], parsed.refs  # nothing fetched
    assert "<link" not in page and "<script" not in page  # styles inline; user text escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<svg") == 2 and "<polyline" in page  # loss curve + interval, inline
    assert "PROMOTED" in page and "version 2" in page and "accuracy rose by +0.700" in page
    assert "[+0.400, +0.900]" in page and "8 examples fixed, 1 broken" in page
    assert "cache hit" in page and "run-1" in page and "1 cache hit(s)" in page
    assert "no leakage" in page and "2</b> of 2 passed" in page
    assert "fixed (wrong before, right after)" in page and "broken (right before, wrong after)" in page
    assert "beats it" in page  # the champion compared against


def test_report_names_the_vertex_model_version() -> None:
    vertex = {"model": "projects/p/locations/l/models/loraflow-tiny", "version_id": "3",
              "version_aliases": ["champion", "default"]}  # fmt: skip
    page = report.render(constructed() | {"publish": constructed()["publish"] | {"vertex_model_registry": vertex}})
    assert "projects/p/locations/l/models/loraflow-tiny@3</code> (aliases: champion, default)" in page


def test_report_of_a_run_the_gate_did_not_promote() -> None:
    data = constructed() | {
        "decision": DECISION | {"promote": False, "reason": "less than the required +0.300; not promoted"},
        "publish": None,
    }
    page = report.render(data)
    assert "NOT PROMOTED" in page and "less than the required" in page and "Not published" in page


def test_report_shows_the_regression_guard_beside_the_task_metric() -> None:
    """Both accuracies on the guard set, its evidence and its verdict; a failed guard says by how much."""
    check = {"passed": False, "set": "general-mc-v1 (sha256 e230efbd3157)", "n": 100, "base": 0.6, "tuned": 0.45,
             "delta": -0.15, "ci": [-0.23, -0.08], "confidence": 0.95, "max_drop": 0.05, "rule": "estimate",
             "fixed": 0, "broken": 15, "reason": "guard general-mc-v1: a drop of 0.150, more than the allowed 0.050 "
             "(by 0.100)"}  # fmt: skip
    guard = {"set": "general-mc-v1", "sha256": "e230efbd31570b51", "n": 100}
    data = constructed() | {
        "base_metrics": constructed()["base_metrics"] | {"guard": guard | {"accuracy": 0.6}},
        "tuned_metrics": constructed()["tuned_metrics"] | {"guard": guard | {"accuracy": 0.45}},
        "decision": DECISION | {"promote": False, "guard": check, "reason": "...; but the regression guard failed"},
        "publish": None,
    }
    page = report.render(data)
    assert "Regression guard" in page and "<code>general-mc-v1</code> (sha256 <code>e230efbd3157</code>" in page
    assert "accuracy <b>0.600</b> before, <b>0.450</b> after" in page
    assert "<b>FAILED</b> (rule estimate, at most 0.050 lost): change <b>-0.150</b>" in page
    assert "[-0.230, -0.080]; 15 questions broken, 0 fixed" in page
    assert "more than the allowed 0.050 (by 0.100)" in page and page.count("<svg") == 3  # + the guard's interval
    assert "8 examples fixed, 1 broken" in page  # the task metric's evidence stays
    assert "Regression guard" not in report.render(constructed())  # no guard, no section


def test_report_shows_each_standard_benchmark_before_and_after_and_a_guard_on_one() -> None:
    """evaluation.suites: a table row per suite (task, metric, documents, both figures, the change); a guard on a
    suite has its verdict under the table's figures."""
    gsm8k = {"task": "gsm8k", "metric": "exact_match,strict-match", "n": 200, "ids": ["0"], "values": [1.0]}
    check = {"passed": True, "set": "suite gsm8k (gsm8k, exact_match,strict-match)", "n": 200, "base": 0.41,
             "tuned": 0.4, "delta": -0.01, "ci": [-0.04, 0.02], "confidence": 0.95, "max_drop": 0.02,
             "rule": "estimate", "fixed": 6, "broken": 8, "reason": "guard passed"}  # fmt: skip
    data = constructed() | {
        "base_metrics": constructed()["base_metrics"] | {"suites": {"gsm8k": gsm8k | {"value": 0.41}}},
        "tuned_metrics": constructed()["tuned_metrics"] | {"suites": {"gsm8k": gsm8k | {"value": 0.4}}},
        "decision": DECISION | {"guard": check},
    }
    page = report.render(data)
    assert "<h3>Standard benchmarks</h3>" in page
    row = re.search(r"<tr><td>gsm8k</td>(.*?)</tr>", page)
    assert row is not None, page
    cells = re.findall(r"<td>(.*?)</td>", row.group(1))
    assert cells[0] == "<code>gsm8k</code> exact_match,strict-match" and cells[1] == "200"
    assert "0.410" in cells[2] and "0.400" in cells[3] and cells[4] == "-0.010"
    assert "On suite gsm8k (gsm8k, exact_match,strict-match).</p>" in page
    assert "<b>passed</b> (rule estimate, at most 0.020 lost): change <b>-0.010</b>" in page
    assert "Standard benchmarks" not in report.render(constructed())  # no suites, no table


def test_the_interval_level_and_the_required_gain_are_the_recorded_ones() -> None:
    """The report shows the levels and thresholds the gate recorded, and invents none for a record without them
    (it said 95% and drew "required +0.000" for any decision that did not say)."""
    check = {"passed": True, "delta": 0.0, "ci": [-0.01, 0.01], "confidence": 0.8, "max_drop": 0.05, "rule": "estimate"}
    guarded = constructed() | {"decision": DECISION | {"confidence": 0.8, "min_improvement": 0.25, "guard": check}}
    page = report.render(guarded)
    assert "80% bootstrap interval <b>[+0.400, +0.900]</b>" in page and "required +0.250" in page
    assert "80% interval [-0.010, +0.010]" in page and "required -0.050" in page
    silent = {k: v for k, v in DECISION.items() if k not in ("confidence", "min_improvement")}
    unsaid = {k: v for k, v in check.items() if k not in ("confidence", "max_drop")}
    page = report.render(constructed() | {"decision": silent | {"guard": unsaid}})
    assert "gain <b>+0.700</b>, bootstrap interval <b>[+0.400, +0.900]</b>" in page
    assert "change <b>+0.000</b>, interval [-0.010, +0.010]" in page
    assert "95%" not in page and "required" not in page.split('id="gate"')[0]


def test_report_renders_with_nothing_but_the_run() -> None:
    page = report.render({"pipeline": "tiny", "run_id": "r"})
    assert set(SECTIONS) <= set(parse(page).ids)
    assert "the gate did not run" in page and "no loss curve" in page


def test_sample_outputs_sorts_examples_by_what_changed() -> None:
    samples = report.sample_outputs(BASE, TUNED, per_kind=3)
    assert [s["id"] for s in samples["fixed"]] == ["eval-000002", "eval-000003", "eval-000004"]
    assert [s["id"] for s in samples["broken"]] == ["eval-000001"]
    assert [s["id"] for s in samples["unchanged"]] == ["eval-000000"]
    assert samples["fixed"][0]["base"] == "banana" and samples["fixed"][0]["tuned"] == "even"


def test_loss_svg_is_a_standalone_svg() -> None:
    svg = report.loss_svg([(1, 6.0), (2, 5.0), (3, float("nan")), (4, 2.0)])
    assert svg.startswith("<svg") and svg.endswith("</svg>") and svg.count(",") >= 3
    assert "no loss recorded" in report.loss_svg([])


INF, NAN, HUGE = float("inf"), float("nan"), 1e308


def _plotted(svg: str) -> list[tuple[float, float]]:
    """The polyline's points, after checking the SVG is well-formed XML with finite coordinates only."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)
    for element in root.iter():
        for name in ("x", "y", "x1", "x2", "y1", "y2", "width", "height"):
            if name in element.attrib:
                assert math.isfinite(float(element.attrib[name])), (name, element.attrib)
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    if not lines:
        return []
    return [(float(x), float(y)) for x, y in (p.split(",") for p in lines[0].attrib["points"].split())]


@pytest.mark.parametrize(
    "rows",
    [
        [(1, 2.0), (INF, 1.0), (NAN, 1.0), (-INF, 1.5), (3, 1.0)],  # steps that are not finite
        [(1, HUGE), (2, -HUGE), (3, 0.0)],  # losses at the ends of the float range
        [(1, 1.7e308), (2, -1.7e308)],
        [(1, 5e-324), (2, 0.0), (3, 1e-320)],  # subnormal losses
        [(1e308, 1.0), (-1e308, 2.0)],  # steps at the ends of the range
        [(1, 1.0), (1, 1.0)],  # one point twice
        [(0, 1e-300), (1, 2e-300)],
        [(1, "x"), ("y", 1.0), (None, 2.0), (2,), (3, 1.0), (4, 0.5)],  # rows that are not numbers
    ],
)
def test_the_loss_curve_draws_the_finite_points_of_any_row(rows: list) -> None:
    """Issue 29, item 10: inf/nan steps raised ValueError, +/-1e308 losses OverflowError, and the report
    step failed with them. Rows without a finite step and loss are left out; the rest are drawn inside
    the plot, scaled without overflowing."""
    svg = report.loss_svg(rows)
    points = _plotted(svg)
    finite = [r for r in rows if len(r) >= 2 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in r[:2])]
    assert len(points) == len(finite)
    assert all(56 <= x <= 640 - 16 and 14 <= y <= 260 - 40 for x, y in points), points


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(), st.floats()), max_size=12))
def test_any_loss_rows_make_a_curve_of_their_finite_points(rows: list[tuple[float, float]]) -> None:
    points = _plotted(report.loss_svg(rows))
    assert len(points) == sum(math.isfinite(x) and math.isfinite(y) for x, y in rows)
    assert all(56 <= x <= 640 - 16 and 14 <= y <= 260 - 40 for x, y in points), points


def test_the_loss_curve_keeps_its_scale_at_the_ends_of_the_range() -> None:
    """Scaled, not clipped: the point at 1e308 is drawn above the one at 0 and that one above -1e308."""
    (_, top), (_, middle), (_, bottom) = _plotted(report.loss_svg([(1, HUGE), (2, 0.0), (3, -HUGE)]))
    assert top < middle < bottom and abs((top + bottom) / 2 - middle) < 1


def test_browser_urls() -> None:
    uri = "gs://bucket/arts/tiny/manual__2026-01-01T00:00:00+00:00/report/report.html"
    local = urls.browser_url(uri, "http://127.0.0.1:9023")
    assert local == (
        "http://127.0.0.1:9023/download/storage/v1/b/bucket/o/"
        "arts%2Ftiny%2Fmanual__2026-01-01T00%3A00%3A00%2B00%3A00%2Freport%2Freport.html?alt=media"
    )
    assert urls.browser_url(uri, "127.0.0.1:9023").startswith("http://127.0.0.1:9023/download/")
    assert urls.browser_url(uri) == (
        "https://storage.cloud.google.com/bucket/arts/tiny/manual__2026-01-01T00%3A00%3A00%2B00%3A00/report/report.html"
    )


# --------------------------------------------------------------------------------- the step


def commit(prefix: str, tmp_path: Path, files: dict[str, str], summary: dict[str, Any]) -> artifacts.Manifest:
    local = tmp_path / prefix.replace("/", "_").replace(":", "")
    local.mkdir(parents=True)
    for name, text in files.items():
        (local / name).write_text(text)
    table = artifacts.upload_tree(local, prefix)
    stage = prefix.rsplit("/", 1)[-1]
    return artifacts.commit(
        prefix, table, stage=stage, inputs={}, config={}, lock_version="t", cache_key="k", summary=summary
    )


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def committed_run(gcs_bucket: str, tmp_path: Path) -> Callable[[bool], dict[str, artifacts.Manifest]]:
    """A run's committed artifacts: lora_sft (and convert_checkpoint) reused from an earlier run."""

    def make(published: bool) -> dict[str, artifacts.Manifest]:
        run2, run1 = f"{gcs_bucket}/arts/tiny/run-2", f"{gcs_bucket}/arts/tiny/run-1"
        files: dict[str, tuple[str, dict[str, str]]] = {
            "validate_data": (run2, {"data_report.json": json.dumps(DATA_REPORT), "train.jsonl": "{}\n"}),
            "convert_checkpoint": (run1, {"checkpoint.bin": "x" * 100}),
            "evaluate_base": (run2, {"metrics.json": json.dumps({"accuracy": 0.2, "n": 10, "correct": [0] * 10}),
                                     "predictions.jsonl": jsonl(BASE)}),
            "lora_sft": (run1, {"loss.csv": LOSS, "adapter.bin": "a"}),
            "merge_adapter": (run2, {"model.safetensors": "m"}),
            "evaluate_tuned": (run2, {"metrics.json": json.dumps({"accuracy": 0.9, "n": 10}),
                                      "predictions.jsonl": jsonl(TUNED)}),
            "gate": (run2, {"decision.json": json.dumps(DECISION | {"promote": published})}),
        }  # fmt: skip
        manifests = {
            stage: commit(gcs.join(run, stage), tmp_path, content, {"seconds": 1.5 + i})
            for i, (stage, (run, content)) in enumerate(files.items())
        }
        if published:
            entry = {"promoted": True, "version": 4, "alias": "champion", "version_uri": "gs://b/_registry/v4"}
            commit(gcs.join(run2, "publish"), tmp_path, {"registry_entry.json": json.dumps(entry)}, {"seconds": 0.2})
        return manifests

    return make


def report_ctx(make_ctx: Callable, manifests: dict[str, artifacts.Manifest], run_prefix: str) -> Any:
    ctx = make_ctx("report", {}, {"pipeline": "tiny", "stages": [*REPORTED, "publish"]}, manifests)
    ctx.output_uri = gcs.join(run_prefix, "report")
    return ctx


def test_report_step_on_a_promoted_run(committed_run: Callable, make_ctx: Callable, gcs_bucket: str) -> None:
    manifests = committed_run(True)
    ctx = report_ctx(make_ctx, manifests, f"{gcs_bucket}/arts/tiny/run-2")
    summary = report_step.run(ctx)
    assert summary["report"] == f"{gcs_bucket}/arts/tiny/run-2/report/report.html"
    assert summary["cache_hits"] == ["convert_checkpoint", "lora_sft"] and summary["promote"] is True
    page = (ctx.out / "report.html").read_text()
    assert set(SECTIONS) <= set(parse(page).ids)
    assert "version 4" in page and "PROMOTED" in page
    assert "took 4.5 in run run-1" in page  # lora_sft: reused, with what it cost where it ran
    assert "<polyline" in page and "eval-000002" in page
    assert (ctx.out / "loss.svg").read_text().startswith("<svg")
    # only the small files were fetched, never a checkpoint
    fetched = {p.name for p in ctx.work.rglob("*") if p.is_file()}
    assert fetched <= {"data_report.json", "metrics.json", "predictions.jsonl", "loss.csv", "decision.json",
                       "registry_entry.json"}  # fmt: skip


def test_report_step_on_a_run_that_was_not_published(
    committed_run: Callable, make_ctx: Callable, gcs_bucket: str
) -> None:
    manifests = committed_run(False)
    ctx = report_ctx(make_ctx, manifests, f"{gcs_bucket}/arts/tiny/run-2")
    report_step.run(ctx)
    page = (ctx.out / "report.html").read_text()
    assert "NOT PROMOTED" in page and "not run" in page  # publish was skipped


REJECTED_REPORT = {
    "success": False,
    "failed_rules": ["no_empty_strings", "duplicates"],
    "failures": [
        "train: 1 row has an empty completion (line 4 of train.jsonl); write the text or drop those rows",
        "train: 1 row repeats an earlier example exactly (12 = 11), a share of 0.005 > max_fraction 0.0; "
        "drop the repeats or raise data.expectations.duplicates.max_fraction",
    ],
    "warnings": ["train: 1 row has a prompt or completion with fewer than 1 letter(s) or digit(s) (line 7)"],
    "data_docs": "data_docs/index.html",
    "expectations": [
        {"dataset": "train", "rule": "no_empty_strings", "level": "fail", "outcome": "fail",
         "check": "completion not empty", "type": "expect_column_values_to_not_match_regex",
         "observed": "1 of 2000 rows (0.1%)", "success": False},
        {"dataset": "train", "rule": "near_empty", "level": "warn", "outcome": "warn",
         "check": "prompt and completion hold text", "type": "expect_column_values_to_be_between",
         "observed": "1 of 2000 rows (0.1%)", "success": False},
        {"dataset": "eval", "rule": "leakage", "level": "fail", "outcome": "pass",
         "check": "no prompt shared with train", "type": "expect_column_values_to_not_be_in_set",
         "observed": "0 of 400 rows (0.0%)", "success": True},
    ],
    "statistics": {"evaluated_expectations": 3, "successful_expectations": 1, "warned_expectations": 1,
                   "train": {"rows": 2000, "format": "prompt_completion", "file": "train.jsonl"}},
}  # fmt: skip


def rows_of(page: str, section: str) -> list[list[str]]:
    """The cells (text only) of every table row in one section of the page."""
    body = page.split(f'<section id="{section}">', 1)[1].split("</section>", 1)[0]
    return [
        [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", body)
    ]


def test_report_shows_each_expectation_with_rule_level_observed_and_outcome() -> None:
    page = report.render(constructed() | {"data_report": REJECTED_REPORT | {"success": True, "failures": []}})
    rows = [r for r in rows_of(page, "data") if len(r) == 7]
    assert ["train", "near_empty", "warn", "prompt and completion hold text",
            "expect_column_values_to_be_between", "1 of 2000 rows (0.1%)", "WARN"] in rows  # fmt: skip
    assert ["eval", "leakage", "fail", "no prompt shared with train",
            "expect_column_values_to_not_be_in_set", "0 of 400 rows (0.0%)", "pass"] in rows  # fmt: skip
    assert "1 warned" in page and "warning: train: 1 row has a prompt or completion" in page


def test_report_step_on_a_run_whose_data_was_rejected(gcs_bucket: str, make_ctx: Callable) -> None:
    import os

    run = f"{gcs_bucket}/arts/tiny/run-3"
    # validate_data's evidence of the rejection: beside its prefix, never committed (no manifest).
    artifacts.write_json(gcs.join(run, "validate_data", "_rejected", "data_report.json"), REJECTED_REPORT)
    host = os.environ["STORAGE_EMULATOR_HOST"].rstrip("/")  # the session's emulator (tests/conftest.py)
    ctx = report_ctx(make_ctx, {}, run)
    summary = report_step.run(ctx)
    assert summary["failed_stage"] == "validate_data" and summary["promote"] is None
    page = (ctx.out / "report.html").read_text()
    verdict = page.split('<section id="verdict">', 1)[1].split("</section>", 1)[0]
    assert "RUN FAILED" in verdict and "<code>validate_data</code>" in verdict
    assert "the data contract is broken: 2 rule(s) failed (no_empty_strings, duplicates)" in verdict
    assert "line 4 of train.jsonl" in verdict and "raise data.expectations.duplicates.max_fraction" in verdict
    assert "Nothing was converted or trained" in verdict
    stages = {r[0]: r[1] for r in rows_of(page, "stages") if r}
    assert stages["validate_data"] == "rejected" and stages["lora_sft"] == "no output"
    assert stages["publish"] == "not run"
    bucket, path = gcs.split_uri(gcs.join(run, "validate_data", "_rejected", "data_docs", "index.html"))
    assert f'href="{host}/{bucket}/{path}"' in page  # GX's data docs of the rejected data


def test_report_step_on_a_run_where_training_failed(
    committed_run: Callable, make_ctx: Callable, gcs_bucket: str
) -> None:
    manifests = committed_run(False)
    kept = {s: m for s, m in manifests.items() if s in ("validate_data", "convert_checkpoint", "evaluate_base")}
    ctx = report_ctx(make_ctx, kept, f"{gcs_bucket}/arts/tiny/run-2")
    summary = report_step.run(ctx)
    assert summary["failed_stage"] == "lora_sft"
    page = (ctx.out / "report.html").read_text()
    assert "RUN FAILED" in page
    assert "no committed output from lora_sft, merge_adapter, evaluate_tuned, gate" in page
    assert "2000" in page  # the dataset summary is still there


def test_data_docs_urls_keep_the_path_for_relative_links() -> None:
    uri = urls.data_docs_uri("gs://bucket/arts/tiny/run-1/validate_data", rejected=True)
    assert uri == "gs://bucket/arts/tiny/run-1/validate_data/_rejected/data_docs/index.html"
    assert urls.site_url(uri, "127.0.0.1:9023") == (
        "http://127.0.0.1:9023/bucket/arts/tiny/run-1/validate_data/_rejected/data_docs/index.html"
    )
    assert urls.site_url(uri) == urls.browser_url(uri)


def test_only_the_report_runs_without_its_upstream_outputs() -> None:
    from loraflow.errors import LoraflowError
    from loraflow.pipeline import runner
    from loraflow.pipeline.plan import stage_plans
    from loraflow.spec.schema import load_spec

    plans = stage_plans(load_spec(Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml"))
    got = runner.resolve_inputs(plans["report"], {"validate_data": "gs://b/arts/tiny/run-1/validate_data"})
    assert got == {"validate_data": "gs://b/arts/tiny/run-1/validate_data/_MANIFEST.json"}
    with pytest.raises(LoraflowError, match="lora_sft needs the output of validate_data, which did not run"):
        runner.resolve_inputs(plans["lora_sft"], {"convert_checkpoint": "gs://b/arts/tiny/run-1/convert_checkpoint"})


def test_the_report_task_runs_after_a_failure_and_keeps_the_run_failed() -> None:
    import yaml

    from operators.stages import ReportOperator

    class TI:
        dag_id, run_id, task_id = "tiny", "r1", "report"

        def get_task_states(self, dag_id: str, run_ids: list[str]) -> dict[str, dict[str, str]]:
            assert (dag_id, run_ids) == ("tiny", ["r1"])
            return {"r1": {"validate_data": "failed", "lora_sft": "upstream_failed", "publish": "upstream_failed",
                           "evaluate_base": "success", "report": "running"}}  # fmt: skip

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml").read_text())
    op = ReportOperator.for_spec(data)
    assert op.trigger_rule == "all_done"  # it runs whatever happened before it
    assert op.failed_tasks({"ti": TI()}) == ["lora_sft", "publish", "validate_data"]  # type: ignore[arg-type]
