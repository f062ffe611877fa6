"""Support for tests and benchmarks (not the serving path): executor wiring with a simulated decode
side (``harness``) and the soak driver (``soak``)."""
