"""``python -m bench.multiturn``: multi-turn conversations, device-only vs the L2 cache under each
write policy, on one rank or ``--tp N``."""
