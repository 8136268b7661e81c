"""loraflow's Airflow-facing layer: one operator per stage, and the DAG factory.

Nothing here imports JAX, vLLM, Great Expectations, pandas, gcsfs or the Vertex SDK at module level:
the scheduler parses DAG files constantly, and the step programs run in their own environments.
"""
