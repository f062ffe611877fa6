"""The real decode transport (``--disaggregation-transfer-backend mooncake``): SGLang 0.5.23's
Mooncake PD protocol between the prefill side (``link``, ``sender``, ``session_worker``,
``bootstrap``) and decode worker processes (``decode_worker``, ``receiver``), over ``wire``,
``layout`` and ``engine``. Availability and the loopback refusal:
``hicache.storage.mooncake.availability``. See docs/DESIGN.md section 12."""
