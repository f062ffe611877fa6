"""Prefill side of PD disaggregation: the optimistic prefill executor and what it runs on."""
