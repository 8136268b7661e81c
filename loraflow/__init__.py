"""loraflow: declarative LoRA fine-tuning pipelines (Airflow-free core)."""

__version__ = "0.1.0"
