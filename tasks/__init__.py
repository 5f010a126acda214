"""pkvbench's task definitions (YAML). Installed as the package data ``pkvbench.task_definitions``; no code here."""
