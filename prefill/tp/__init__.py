"""Tensor parallelism of the executor: what ranks agree on (``sync``) and who drives the steps
(``driver``)."""
