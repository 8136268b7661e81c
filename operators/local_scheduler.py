"""``airflow scheduler`` with its LocalExecutor's forkserver started at once (the local stack's scheduler).

With ``[scheduler] mp_start_method = forkserver`` the LocalExecutor starts its forkserver, which then
imports ``[scheduler] mp_forkserver_preload``, only when the first task is queued: the first run after a
stack start waited 4-5 s for it on 2 cores before its first task began. Started here, the forkserver
imports them while the scheduler, the API server and the DAG processor come up; the executor's first
worker then connects to the running server (multiprocessing keeps one per process). With any other start
method this is plain ``airflow scheduler``. Usage: ``python -m operators.local_scheduler [airflow
scheduler's arguments]``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import sys
import threading


def prestart_forkserver() -> threading.Thread | None:
    """Apply the scheduler's start method and preload as Airflow will, and start the forkserver in the
    background when that method is ``forkserver``."""
    from airflow.utils.process_utils import set_component_mp_start_method

    set_component_mp_start_method("scheduler")
    if multiprocessing.get_start_method() != "forkserver":
        return None
    thread = threading.Thread(target=multiprocessing.forkserver.ensure_running, name="forkserver-start", daemon=True)
    thread.start()
    return thread


def main() -> None:
    prestart_forkserver()
    from airflow.__main__ import main as airflow_main

    sys.argv = ["airflow", "scheduler", *sys.argv[1:]]
    airflow_main()


if __name__ == "__main__":
    main()
