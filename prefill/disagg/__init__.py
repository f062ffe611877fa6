"""PD disaggregation's decode side as the prefill executor sees it: the protocol (``protocol``),
the backend ``--disaggregation-transfer-backend`` picks (``backends``), the in-process simulation
(``simulated``) and the real Mooncake transport (``mooncake/``)."""
