"""Local `evaluate` metric modules, loaded by directory path (`evaluate.load(path)`), never from the hub."""
