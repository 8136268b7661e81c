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
