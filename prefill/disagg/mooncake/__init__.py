"""The real decode transport (``--disaggregation-transfer-backend mooncake``): SGLang 0.5.23's
Mooncake PD protocol between the prefill side and decode worker processes. See docs/DESIGN.md
section 12."""
