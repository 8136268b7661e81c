"""Scoring model outputs and the quality gate's decision rule."""
