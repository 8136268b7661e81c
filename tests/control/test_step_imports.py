"""A step imports its heavy libraries with the cyclic garbage collector off and freezes what they made
(``_harness.import_permanently``): faster imports and cheap later collections. Whatever happens, the
collector is left as the step found it: left off, a training run's cyclic garbage would never be freed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# In a fresh interpreter: freezing objects is for the whole process, not for pytest's.
CHILD = """
import gc, json, sys
from loraflow.steps._harness import import_permanently

seen = {}
frozen_before = gc.get_freeze_count()
import_permanently("email.mime.text", "xml.dom.minidom")
seen["imported"] = all(m in sys.modules for m in ("email.mime.text", "xml.dom.minidom"))
seen["frozen"] = gc.get_freeze_count() > frozen_before
seen["on_after"] = gc.isenabled()
frozen = gc.get_freeze_count()
import_permanently("email.mime.text")  # imported already: nothing to do, nothing more frozen
seen["again_freezes_nothing"] = gc.get_freeze_count() == frozen

try:
    import_permanently("loraflow_no_such_library")
except ModuleNotFoundError:
    seen["missing_raises"] = True
seen["on_after_a_failed_import"] = gc.isenabled()

gc.disable()
import_permanently("csv")
seen["off_stays_off"] = not gc.isenabled()
print(json.dumps(seen))
"""


def test_heavy_imports_leave_the_garbage_collector_as_they_found_it() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "imported": True,
        "frozen": True,
        "on_after": True,
        "again_freezes_nothing": True,
        "missing_raises": True,
        "on_after_a_failed_import": True,
        "off_stays_off": True,
    }
