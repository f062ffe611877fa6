"""The L3 tier's file backend, measured on a CPU (``python -m bench.l3``, ``bench``): a restart's
hit rate in fresh processes and the page bandwidth against plain files."""
