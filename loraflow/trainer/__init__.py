"""The training program: what ``python -m loraflow.steps.lora_sft`` runs, in modules named for their part.

Trainer environment only (JAX, MaxText, Tunix); docs/architecture.md lists the modules. The step
program (``loraflow/steps/lora_sft.py``) reads its typed config and hands it here; nothing outside this
package uses its private names.
"""
