"""The report commands' choices and defaults (check, report, export, compare), in a module of their own that imports
nothing: the command line reads them when it starts, and the modules whose meaning they are import pandas."""

# pkvbench check (check.py): the points a cell's score may fall before it can fail; whether the kept sets are compared
# with the baseline's (on, off); the least share of kept entries a cell has in common with the baseline's.
TOLERANCE = 2.0
SELECTION = ("on", "off")
MIN_OVERLAP = 0.99
# pkvbench report --view (frontier.py): the score table, each cell's bytes and score, the memory targets' comparisons,
# each storage format's entries and bytes as stored.
VIEWS = ("table", "frontier", "memory-diff", "memory")
# pkvbench export --format (export.py): the other harnesses whose layout pkvbench writes.
EXPORT_FORMATS = ("kvpress",)
# pkvbench compare --reference and the HTML report's comparison: the paper's table shipped with pkvbench
# (paper_compare.REFERENCES).
PAPER_REFERENCE = "pyramidkv-table1"
