"""Load generators for a running hybrid-serve endpoint (see `bench_client`)."""
