//! End-to-end tests and benchmarks live in `tests/` and `benches/`.
