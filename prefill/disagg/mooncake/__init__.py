"""The real decode transport (``--disaggregation-transfer-backend mooncake``): SGLang 0.5.23's
Mooncake PD protocol between this process (the prefill side) and decode worker processes.

Prefill side: ``link`` (``MooncakeBackend`` / ``MooncakeLink``, what the executor sees),
``sender`` (rooms, control plane, bootstrap endpoint), ``session_worker`` (one transfer worker
and engine per decode session), ``bootstrap``. Decode side: ``receiver`` (its request queues),
``decode_worker`` (the process, ``python -m prefill.disagg.mooncake.decode_worker``). Both:
``wire`` (control messages), ``layout`` (geometry, layer buffers, metadata rows), ``engine``
(the transfer engine). The availability checks and the loopback shim are shared with the
Mooncake Store: ``hicache.mooncake``.
See docs/DESIGN.md section 12."""
