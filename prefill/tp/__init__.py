"""Tensor parallelism of the executor: what ranks agree on (``sync``), who drives the steps
(``driver``) and the CPU launcher of rank processes (``launch``)."""
