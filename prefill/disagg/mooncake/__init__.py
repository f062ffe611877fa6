"""The real decode transport (``--disaggregation-transfer-backend mooncake``): SGLang 0.5.23's
Mooncake PD protocol, on its own wire, between the prefill side and SGLang 0.5.23 decode servers
or this project's decode worker processes. See docs/DESIGN.md section 12."""
