"""Scaffolding for tests and benchmarks: the runtime (``dpq/`` outside this package) and the
auto-round adapter never import it (``tests/test_layout.py`` checks)."""
