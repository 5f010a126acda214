"""Reference tables (the PyramidKV paper's Table 1). Installed as the package data ``pkvbench.reference_tables``."""
