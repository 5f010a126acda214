"""Result folders on disk: the append-only result store with resume, one writer per folder (lock), and the rule for
every other file pkvbench writes (outputs)."""
