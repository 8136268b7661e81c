"""Running a pipeline: the stage plan, the runner that starts a stage through its launcher, the data
teams' hand-off around a run, and the run's OpenLineage events.
"""
