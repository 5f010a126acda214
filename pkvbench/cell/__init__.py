"""A cell's vocabulary: the result row's fields (schema), budgets, storage formats and selection fingerprints.

Plain Python, no torch or pandas: the command line, the store and the reports all read it, and it imports nothing of
pkvbench but ``errors``, ``config`` and ``io``."""
