"""A person in the Airflow UI: trigger the tiny pipeline from the trigger form with a changed parameter,
watch it succeed, open the run report from the report task's "Run report" link. And a person opening
the data docs of a dataset whose ids and prompts carry script: none of it runs.

Playwright drives the system Chromium (``apt-get install -y chromium``; ``make test-e2e`` installs it)
against a real local Airflow and the GCS emulator (the data docs test needs the emulator only): the stack
the end-to-end modules share (tests/e2e/conftest.py), where the tiny pipeline's copy here has a DAG name
of its own and test_tiny_pipeline.py's artifact root: run after that module (CACHE_FROM), its run takes
validate_data, convert_checkpoint and evaluate_base from the cache and trains, merges and evaluates its own.
Screenshots of every step are kept under tests/_artifacts/browser/ (ignored by git); the test prints
the folder. About 5 minutes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from loraflow.dev.demo import LocalAirflow, prepare
from loraflow.dev.shared_stack import SharedStack
from loraflow.spec.schema import load_spec
from tests.bad_datasets import SCRIPT_PAYLOADS, script_payload_dataset

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "tiny-llama-lora.yaml"
DAG = "tiny-browser"
CHROMIUM = Path(os.environ.get("LORAFLOW_CHROMIUM", "/usr/lib/chromium/chromium"))
SHOTS = REPO / "tests" / "_artifacts" / "browser"
DOCS_SHOTS = REPO / "tests" / "_artifacts" / "browser-data-docs"
# The module whose runs (before this one's) leave the stages this run shares with them in the cache.
CACHE_FROM = "test_tiny_pipeline"  # its __name__, as it names itself to the stack
STEPS = 50  # changed in the form from the spec's 200: a shorter run that still succeeds (promoted or not)
UI_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def shots() -> Path:
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    print(f"\n[browser test] screenshots in {SHOTS}")
    return SHOTS


def browser_spec(folder: Path) -> Path:
    """The tiny pipeline as a user has it, under a DAG name of its own in the shared stack."""
    path = folder / f"{DAG}.yaml"
    path.write_text(TINY.read_text().replace("name: tiny-llama-lora", f"name: {DAG}"))
    spec = load_spec(path)
    assert (spec.name, spec.artifact_root) == (DAG, load_spec(TINY).artifact_root)
    return path


def test_trigger_from_the_form_and_open_the_run_report(
    tmp_path_factory: pytest.TempPathFactory, shots: Path, shared_stack: SharedStack
) -> None:
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: install Chromium with `apt-get install -y chromium`"
    home = tmp_path_factory.mktemp("browser")
    airflow = shared_stack.use(__name__, browser_spec(home), cache_from=CACHE_FROM)
    with sync_playwright() as pw:
        prepare(TINY, home)
        airflow.wait_for_dag(DAG)
        airflow.call("PATCH", f"/dags/{DAG}", {"is_paused": False})
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.add_cookies([{"name": "_token", "value": airflow.token(), "url": airflow.url}])
        context.set_default_timeout(UI_TIMEOUT_MS)
        page = context.new_page()
        try:
            run_in_browser(airflow, context, page, shots)
        except Exception:
            page.screenshot(path=shots / "failure.png", full_page=True)
            (shots / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
    assert sorted(p.name for p in shots.iterdir()) == [
        "1-dag.png",
        "2-trigger-form.png",
        "3-run.png",
        "4-report-task.png",
        "5-report.png",
    ]


def run_in_browser(airflow: LocalAirflow, context: BrowserContext, page: Page, shots: Path) -> None:
    """Trigger from the form with a changed parameter, wait for success, open the run report."""
    from playwright.sync_api import expect

    expect.set_options(timeout=UI_TIMEOUT_MS)  # expect() has its own 5 s default, too short for a busy 2-core machine
    # The DAG page, then its trigger form with the spec's params.
    page.goto(f"{airflow.url}/dags/{DAG}")
    expect(page.get_by_text(DAG).first).to_be_visible()
    page.screenshot(path=shots / "1-dag.png")
    page.get_by_role("button", name="Trigger Dag").click()
    dialog = page.get_by_role("dialog")
    steps = dialog.get_by_label("training.steps")  # the param's title: its dotted path in the spec
    expect(steps).to_have_value("200")
    steps.fill(str(STEPS))
    dialog.screenshot(path=shots / "2-trigger-form.png")
    dialog.get_by_role("button", name="Trigger", exact=True).click()
    # .first: the UI's toast can be in the page twice while it animates in (the same toast, one run).
    expect(page.get_by_text("Dag run has been successfully triggered.").first).to_be_visible()

    run_id = latest_run(airflow, DAG)
    _, run = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}")
    assert run["conf"]["training_steps"] == STEPS, run["conf"]
    state = airflow.wait_for_run(DAG, run_id, timeout=900)
    page.goto(f"{airflow.url}/dags/{DAG}/runs/{run_id}")
    expect(page.get_by_text(DAG).first).to_be_visible()
    page.wait_for_load_state("networkidle")
    page.screenshot(path=shots / "3-run.png", full_page=True)
    assert state == "success"
    trained = airflow.xcom(DAG, run_id, "lora_sft")["summary"]
    assert trained["steps"] == STEPS, trained

    # The report task's extra link opens the run report.
    page.goto(f"{airflow.url}/dags/{DAG}/runs/{run_id}/tasks/report")
    page.get_by_text("Details", exact=True).click()  # extra links are shown on the task's Details tab
    link = page.get_by_role("link", name="Run report")
    expect(link).to_be_visible()
    page.screenshot(path=shots / "4-report-task.png", full_page=True)
    _, links = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/report/links")
    assert link.get_attribute("href") == links["extra_links"]["Run report"], links
    if link.get_attribute("target") == "_blank":  # Airflow opens links to other hosts in a new tab
        with context.expect_page() as opened:
            link.click()
        report = opened.value
    else:
        link.click()
        report = page
    report.wait_for_load_state()
    expect(report.get_by_text("Sample outputs")).to_be_visible()
    report.screenshot(path=shots / "5-report.png", full_page=True)
    assert DAG in report.inner_text("body")


def latest_run(airflow: LocalAirflow, dag_id: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = airflow.call("GET", f"/dags/{dag_id}/dagRuns?order_by=-run_after&limit=1")
        runs = body.get("dag_runs", []) if isinstance(body, dict) else []
        if runs:
            return str(runs[0]["dag_run_id"])
        time.sleep(1)
    raise AssertionError(f"the trigger form started no run of {dag_id}")


def test_script_in_a_dataset_never_runs_in_its_data_docs(tmp_path: Path, gcs_bucket: str) -> None:
    """validate_data, as Airflow's task runs it, refuses a dataset whose ids and prompts carry script
    (tests/bad_datasets.py); Chromium opens every page of its data docs where the "Data docs" link
    and the run report send a reader (the emulator's origin): no payload runs, each id reads as typed.
    No Airflow: the pages are the step's, served by the store."""
    from playwright.sync_api import sync_playwright

    from loraflow.errors import LoraflowError
    from loraflow.pipeline import runner
    from loraflow.reporting.urls import data_docs_uri, site_url
    from loraflow.storage import artifacts, gcs

    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: install Chromium with `apt-get install -y chromium`"
    spec = _spec_on(script_payload_dataset(tmp_path / "data"), tmp_path, gcs_bucket)
    with pytest.raises(LoraflowError, match="the data contract is broken"):
        runner.run_stage(spec, "validate_data", "run-xss", {}, print)
    stage = artifacts.stage_prefix(spec.artifact_root, spec.name, "run-xss", "validate_data")
    docs = data_docs_uri(stage, rejected=True).rsplit("/", 1)[0]
    bucket, base = gcs.split_uri(docs)
    names = sorted(b.name for b in gcs.client().list_blobs(bucket, prefix=f"{base}/") if b.name.endswith(".html"))
    assert len(names) == 5, names  # the index, both suites, both validation results
    host = os.environ["STORAGE_EMULATOR_HOST"]
    urls = [site_url(f"gs://{bucket}/{name}", host) for name in names]
    shutil.rmtree(DOCS_SHOTS, ignore_errors=True)
    DOCS_SHOTS.mkdir(parents=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            _a_raw_payload_is_caught(browser)
            for i, url in enumerate(urls):
                _open_and_check(browser, url, DOCS_SHOTS / f"{i}-{url.rsplit('/', 1)[1]}.png")
        finally:
            browser.close()


def _spec_on(data: Path, tmp: Path, gcs_bucket: str):  # type: ignore[no-untyped-def]
    """The tiny spec reading ``data``'s train.jsonl and eval.jsonl and a tokenizer from the emulator."""
    from loraflow.spec.schema import load_spec, with_overrides
    from loraflow.storage import gcs
    from tests.control.conftest import write_tokenizer

    bucket_name, base = gcs.split_uri(gcs_bucket)
    bucket = gcs.client().bucket(bucket_name)
    tokenizer = tmp / "tokenizer"
    tokenizer.mkdir()
    for path in [*data.iterdir(), *write_tokenizer(tokenizer, data / "train.jsonl").iterdir()]:
        bucket.blob(f"{base}/{path.parent.name}/{path.name}").upload_from_filename(str(path))
    spec = load_spec(TINY)
    sources = {"train": f"{gcs_bucket}/data/train.jsonl", "eval": f"{gcs_bucket}/data/eval.jsonl"}
    model = spec.base_model.model_copy(update={"tokenizer": f"{gcs_bucket}/tokenizer"})
    spec = spec.model_copy(
        update={"artifact_root": f"{gcs_bucket}/artifacts", "data": spec.data.model_copy(update=sources)}
        | {"base_model": model}
    )
    return with_overrides(spec, {})


def _a_raw_payload_is_caught(browser: Browser) -> None:
    """The check below sees a payload that does run: each written raw into a table cell sets __pwned."""
    page = browser.new_page()
    for n, payload in enumerate(SCRIPT_PAYLOADS, start=1):
        page.set_content(f"<table><tr><td><div>{payload}</div></td></tr></table>", wait_until="load")
        page.wait_for_function("window.__pwned !== undefined", timeout=10_000)
        assert page.evaluate("window.__pwned") == n
    page.close()


def _open_and_check(browser: Browser, url: str, shot: Path) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    response = page.goto(url, wait_until="load", timeout=UI_TIMEOUT_MS)
    assert response is not None and response.ok, url
    page.wait_for_timeout(500)  # an onerror/onload handler fires after the image fails; give it time
    assert page.evaluate("window.__pwned") is None and page.title() != "pwned", f"a dataset payload ran in {url}"
    assert not dialogs, dialogs
    if "/validations/train_dataset/" in url:  # each id as the data team wrote it, as text (not as tags)
        text = page.text_content("body") or ""
        assert all(payload in text for payload in SCRIPT_PAYLOADS), url
    page.screenshot(path=shot, full_page=True)
    page.close()
