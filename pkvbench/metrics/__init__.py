"""Scoring: pure functions from (prediction, answers, meta) to a score in [0, 1] (``functions``), and the registry a
task's ``metric:`` names them through (``registry``, with other packages' metrics by entry point)."""
