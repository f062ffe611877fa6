"""Prefill side of PD disaggregation: the optimistic prefill executor (``executor``), its
scheduler delegates, requests, the paged model, the decode-peer protocol and its simulation."""
