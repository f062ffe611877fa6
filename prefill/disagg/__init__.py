"""PD disaggregation's decode side as the prefill executor sees it: the protocol (``protocol``)
and the in-process simulation behind it (``sim_config``, ``sim_peer``, ``sim_side``)."""
