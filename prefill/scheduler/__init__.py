"""The executor's delegates, one per scheduler concern: admission (bootstrap and waiting queues),
the chunked request and its batch, a pending attempt's KV, sends and outcomes, the gate and the
metadata buffers."""
