"""Prefill/decode disaggregation over Mooncake on loopback, measured on a CPU (``python -m
bench.pd``): the write cost per item size and its ``CopyPath`` (``rate``), and TTFT with decode
worker processes (``ttft``); ``bench`` runs both and writes ``bench_pd.json``."""
