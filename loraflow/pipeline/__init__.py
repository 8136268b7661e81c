"""Running a pipeline: the stage plan, the runner that starts a stage through its launcher, the
GCS hand-off contract (artifacts, manifests, cache keys), local path confinement and fault injection.
"""
