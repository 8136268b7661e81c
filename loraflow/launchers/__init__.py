"""Where a step program runs: one module per launcher (local processes, Vertex AI CustomJobs, GKE
JobSets), the request builders they use, multi-host wiring, runtime environments and secrets.
"""
