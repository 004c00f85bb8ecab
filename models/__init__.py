"""Reference models used by pscompile's tests, benchmarks and CLI (no pscompile imports here)."""
