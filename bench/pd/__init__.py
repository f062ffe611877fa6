"""PD disaggregation over Mooncake on loopback (``python -m bench.pd``, ``bench``)."""
