"""The executor's delegates: admission, batch runner, pending KV, inflight queue, L3 prefetch."""
