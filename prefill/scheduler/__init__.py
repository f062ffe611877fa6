"""The executor's delegates: admission (bootstrap and waiting queues, the gate), the batch
runner (the running request and its batch), a pending attempt's KV, the inflight queue (sends,
aborts, results) and L3 prefetch."""
