"""Readers of result folders: tables, statistics, paired comparisons, the frontier, the CI gate, exports, the paper
comparison and the HTML page; ``figures/`` draws. Nothing here runs a model."""
