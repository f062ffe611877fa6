"""The L3 tier's file backend on a CPU (``python -m bench.l3``, ``bench``)."""
