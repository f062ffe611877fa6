"""The prefill executor's ranks in lock step under tensor parallelism: what they agree on
(``sync``) and who drives the steps (``driver``)."""
