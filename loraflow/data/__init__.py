"""Datasets: reading and normalising them and rendering them through a chat template (sandboxed)."""
