"""``python -m bench.pd``: prefill/decode disaggregation over the real Mooncake transport on
loopback (wall clock): transfer rate per item size against memcpy and the fitted transfer cost
model (``engine_rate``, with its receiver process ``receiver``), and TTFT with real decode worker
processes (``ttft``); ``bench`` runs them, prints the tables and writes ``bench_pd.json``."""
