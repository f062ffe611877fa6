"""Helpers the tests and benchmarks share (never imported by the product): executor wiring
(``harness``) and the soak driver (``soak``), node processes (``node_*``), the Mooncake decode
router (``mooncake_decode``), master launcher (``mooncake_master``) and loopback shim
(``loopback``, ``bind_loopback.c``), the TP rank spawner (``tp_harness``), KV content writers and
checkers, fault injectors, Triton launch keys."""
