"""Tools for tests, benchmarks and demos (not used by the serving path): the tiny NemotronH checkpoint builder."""
