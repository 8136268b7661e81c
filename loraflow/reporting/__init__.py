"""The run report and the notifications sent about a run."""
