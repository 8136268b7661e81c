"""The ``loraflow`` command (``python -m loraflow.cli``, or the ``loraflow`` script).

``commands.py``: the parser and ``validate``, ``plan``, ``spec-reference``, ``seed``; ``daily.py``: the
daily work beside them (``registry``, ``runs``, ``trigger``, ``verify``), with ``airflow_rest.py``
(Airflow's REST API v2), ``dag_params.py`` (``trigger``'s param check) and ``run_verdicts.py``
(``runs``' verdicts).
"""

from loraflow.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
