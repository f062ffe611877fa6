"""``python -m bench.mooncake_store``: the Mooncake Store as the L3 tier (``bench``), its put/get
bandwidth against memcpy (``bandwidth``) and two prefill instances sharing one store
(``cross``); instances run as node processes (``node``)."""
