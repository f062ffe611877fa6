"""What every Mooncake user in the project shares (the PD transport ``prefill.disagg.mooncake``
and the Mooncake Store backend): ``availability`` (is the wheel installed, does
``libibverbs.so.1`` load, does ``mooncake.engine`` / ``mooncake.store`` import, the one-line skip
reason) and ``loopback`` (the ``LD_PRELOAD`` shim ``bind_loopback.c`` that keeps Mooncake's
listeners on loopback: build and locate it, the environment of a child process that preloads
it, re-executing a driver under it, listeners by pid). Nothing here imports a Mooncake module
at import time."""
