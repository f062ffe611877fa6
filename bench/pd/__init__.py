"""PD disaggregation over Mooncake on loopback, measured on a CPU (``python -m bench.pd``,
``bench``): Mooncake's write cost as a ``CopyPath``, and TTFT with decode workers (``ttft``)."""
