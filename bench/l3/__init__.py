"""The L3 tier's file backend, measured on a CPU (``python -m bench.l3``): a restart's hit rate
in fresh processes (``bench``) and the backend's page bandwidth against plain files
(``bandwidth``)."""
