"""``python -m bench.optimistic``: TTFT with 0, 1 and 2 optimistic prefill attempts."""
