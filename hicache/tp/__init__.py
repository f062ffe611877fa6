"""Agreement between tensor-parallel ranks: the collectives (``group``), decisions taken alike on
every rank (``agreed``) and the state digest (``digest``)."""
