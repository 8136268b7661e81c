"""Child of dag_parse.py (control env): parse one DAG file with a DagBag after a warm-up parse.

argv: WARMUP_FILE TARGET_FILE [--profile OUT]. The warm-up parse of an empty-ish DAG file pays for
Airflow's own lazy imports, as the DAG processor has already paid for them before it parses a file.
"""

import sys
import time

t0 = time.perf_counter()
from airflow.dag_processing.dagbag import DagBag  # noqa: E402

import_airflow_s = time.perf_counter() - t0
warm, target = sys.argv[1], sys.argv[2]
DagBag(dag_folder=warm, safe_mode=False)
before = set(sys.modules)
prof = None
if "--profile" in sys.argv:
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
t1, c1 = time.perf_counter(), time.process_time()
bag = DagBag(dag_folder=target, safe_mode=False)
parse_s, cpu_s = time.perf_counter() - t1, time.process_time() - c1
if prof is not None:
    prof.disable()
    prof.dump_stats(sys.argv[sys.argv.index("--profile") + 1])
new = sorted(set(sys.modules) - before)
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

emit(
    {
        "parse_s": parse_s,
        "cpu_s": cpu_s,
        "import_airflow_s": import_airflow_s,
        "dags": len(bag.dags),
        "import_errors": {k: v[:300] for k, v in bag.import_errors.items()},
        "new_top_modules": sorted({m.split(".")[0] for m in new}),
        "new_modules": len(new),
    }
)
