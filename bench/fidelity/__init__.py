"""``python -m bench.fidelity``: the virtual clock checked against wall time on one small trace of
each end-to-end benchmark."""
