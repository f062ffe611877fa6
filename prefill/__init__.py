"""Prefill side of PD disaggregation: model, simulated decode peer, optimistic prefill executor."""
