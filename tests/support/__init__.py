"""Helpers several test folders share: KV content writers and checkers, the TP rank harness,
Triton launch keys."""
