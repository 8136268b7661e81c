"""6. Orchestration: the tiny pipeline through a real local Airflow + GCS emulator
(loraflow.dev.demo.local_stack, temporary home, emulator in memory): the run's wall time against its
step programs' own seconds (each manifest's summary), and a cached re-run against the first run.
Three runs: the first run right after the stack started (it pays whatever of the stack's start is
unfinished: the scheduler's forkserver and the API server's execution API are readied during it since
2026-12-05, and were paid by the first task before), the cached re-run, and a first run on
the running stack (the cache and the registry emptied first, so every stage computes and the gate
decides as in the first run). One run each (a run takes minutes). Run with the control env's Python.
"""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WORK, compile_imports, machine, save, say

from loraflow.dev import demo
from loraflow.launchers.local import step_environment
from loraflow.pipeline.plan import stage_plans
from loraflow.storage import artifacts, gcs


def _ts(s: str | None) -> float | None:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() if s else None


def one_run(airflow: demo.LocalAirflow, spec, label: str) -> dict:
    t = time.monotonic()
    run_id = airflow.trigger(spec.name, {})
    state = airflow.wait_for_run(spec.name, run_id, progress=lambda m: say(f"{label}: {m.strip()}"))
    poll_wall = time.monotonic() - t
    _, run = airflow.call("GET", f"/dags/{spec.name}/dagRuns/{run_id}")
    _, tis = airflow.call("GET", f"/dags/{spec.name}/dagRuns/{run_id}/taskInstances")
    tasks = {}
    for ti in tis.get("task_instances", []):
        x = airflow.xcom(spec.name, run_id, ti["task_id"]) or {}
        step_s = None
        if x.get("manifest"):
            step_s = artifacts.read_manifest(x["manifest"]).summary.get("seconds")
        tasks[ti["task_id"]] = {
            "state": ti["state"],
            "task_s": ti.get("duration"),
            "step_s": step_s,
            "cached": bool(x.get("cached")),
            "start": _ts(ti.get("start_date")),
            "end": _ts(ti.get("end_date")),
        }
    run_s = (_ts(run.get("end_date")) or 0) - (_ts(run.get("start_date")) or 0)
    plans = stage_plans(spec)

    def critical(key: str) -> float:  # longest chain of `key` seconds through the DAG
        memo: dict[str, float] = {}

        def f(stage: str) -> float:
            if stage not in memo:
                t = tasks.get(stage) or {}
                own = 0.0 if (key == "step_s" and t.get("cached")) else (t.get(key) or 0.0)
                memo[stage] = own + max((f(u) for u in plans[stage].upstream), default=0.0)
            return memo[stage]

        return max(f(s) for s in plans)

    return {
        "run_id": run_id,
        "state": state,
        "run_wall_s": run_s,
        # from the run's start to its first task's: the scheduler's worker start-up (once, in the first run)
        "to_first_task_s": min(t["start"] for t in tasks.values() if t["start"]) - (_ts(run.get("start_date")) or 0),
        "poll_wall_s": poll_wall,
        "sum_step_s": sum(v["step_s"] or 0 for v in tasks.values() if not v["cached"]),
        "sum_task_s": sum(v["task_s"] or 0 for v in tasks.values()),
        "critical_path_step_s": critical("step_s"),
        "critical_path_task_s": critical("task_s"),
        "tasks": tasks,
    }


def empty_cache_and_registry(spec) -> int:
    """Delete the content-addressed cache and the registry: the next run computes every stage and its
    gate finds no champion, as in the first run. Returns how many objects were deleted."""
    client = gcs.client()
    deleted = 0
    for prefix in (gcs.join(spec.artifact_root, "_cache"), spec.registry_uri):
        bucket, path = gcs.split_uri(prefix)
        for blob in client.list_blobs(bucket, prefix=path.rstrip("/") + "/"):
            blob.delete()
            deleted += 1
    return deleted


def main() -> None:
    home = WORK / "orch"
    shutil.rmtree(home, ignore_errors=True)
    # The stack's step programs keep their bytecode in the environments' own caches, which the other
    # benchmarks' children (under common.env's cache) never fill: on a fresh checkout the first run's
    # steps would compile every module they import (84.5 step seconds against 45 on 2026-12-05).
    say("compiling what the step programs import, where they keep it (not measured)")
    compile_imports(step_environment())
    t = time.monotonic()
    with demo.local_stack(home=home, in_memory=True) as airflow:
        startup = time.monotonic() - t
        spec = demo.prepare(home=home)
        airflow.wait_for_dag(spec.name)
        first = one_run(airflow, spec, "first run")
        say(f"first run {first['state']}: {first['run_wall_s']:.1f}s; steps {first['sum_step_s']:.1f}s")
        second = one_run(airflow, spec, "cached re-run")
        say(f"cached re-run {second['state']}: {second['run_wall_s']:.1f}s")
        say(f"emptied the cache and the registry ({empty_cache_and_registry(spec)} objects)")
        warm = one_run(airflow, spec, "first run, running stack")
        say(f"first run on the running stack {warm['state']}: {warm['run_wall_s']:.1f}s")
    save(
        "orchestration",
        {
            "stack_startup_s": startup,
            "first": first,
            "cached_rerun": second,
            "warm_first": warm,
            "machine": machine(),  # the CPU of this section (make bench's header may be another run's)
        },
    )
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
