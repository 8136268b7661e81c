"""Datasets: reading and normalising them, the Great Expectations suite, and the data teams' hand-off."""
