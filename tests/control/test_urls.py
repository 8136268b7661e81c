"""Where a browser opens an artifact (loraflow/reporting/urls.py): the task links, the hand-off and the
demo build URLs without importing the HTML renderer. The URLs themselves: test_report.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["operators.links", "operators.handoff", "operators.stages", "loraflow.dev.demo"])
def test_building_a_link_does_not_import_the_run_report_renderer(module: str) -> None:
    code = f"import sys, {module}; sys.exit('loraflow.reporting.report' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120).returncode == 0


@pytest.mark.parametrize("host", ["127.0.0.1:9023", "http://127.0.0.1:9023", "http://127.0.0.1:9023/"])
def test_the_emulator_is_named_with_or_without_its_scheme_and_slash(host: str) -> None:
    from loraflow.reporting.urls import browser_url, site_url

    uri = "gs://bucket/run/validate_data/data docs/index.html"
    assert browser_url(uri, host) == (
        "http://127.0.0.1:9023/download/storage/v1/b/bucket/o/run%2Fvalidate_data%2Fdata%20docs%2Findex.html?alt=media"
    )
    assert site_url(uri, host) == "http://127.0.0.1:9023/bucket/run/validate_data/data%20docs/index.html"
