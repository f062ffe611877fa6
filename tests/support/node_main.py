"""The command loop of one rank of a node process (a prefill server with its own device and host
pools), commanded by the process that started it (``node_process.StoreNode``), and ``Node``,
what the rank holds. Entry points (``--control HOST:PORT [--rank R --world W --init URL]``):
``python -m tests.support.node_commands`` (executors and bare stores) and ``python -m
tests.support.node_stores`` (bare stores only: no model, a lighter process).

Each rank connects to the control address, says ``{"rank", "pid"}``, then answers one JSON line
per command line: ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``
(``node_commands`` and ``node_stores`` list the commands; ``quit`` closes every executor and
store, answers, and exits at once). Under ``--world 2`` the ranks first join a gloo group at
``--init`` (the tensor-parallel executors' group); the commands reach every rank, and the ranks
agree among themselves as executors do. The process dies with its parent
(``PR_SET_PDEATHSIG``) and runs one intra-op torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.support.loopback import die_with_parent

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Node:
    """One rank's named executors and bare stores (``(store, host_pool)``)."""

    rank: int
    world: int
    executors: dict[str, Any] = dataclasses.field(default_factory=dict)
    references: dict[str, Any] = dataclasses.field(default_factory=dict)
    stores: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: dict[str, int] = dataclasses.field(default_factory=dict)

    def close_all(self) -> None:
        for ex in self.executors.values():
            ex.cache.close()
        self.executors.clear()
        for store, _ in self.stores.values():
            store.close()
        self.stores.clear()


Handler = Callable[[Node, dict], Any]


def main(handlers: dict[str, Handler], argv: list[str] | None = None) -> int:
    """Run one rank's command loop with ``handlers`` (command name -> handler)."""
    p = argparse.ArgumentParser(prog="node")
    p.add_argument("--control", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--init", default=None)
    opts = p.parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=os.environ.get("NODE_LOG_LEVEL", "WARNING"),
                        format=f"[rank {opts.rank} %(asctime)s] %(name)s: %(message)s")  # fmt: skip
    torch.set_num_threads(1)
    if opts.world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=opts.init, rank=opts.rank, world_size=opts.world,
            timeout=datetime.timedelta(hours=1),  # between commands the ranks wait this long
        )  # fmt: skip
    host, port = opts.control.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    stream = sock.makefile("rw", encoding="utf-8")
    _send(stream, {"rank": opts.rank, "pid": os.getpid()})
    node = Node(opts.rank, opts.world)
    table = dict(handlers)
    for line in stream:
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "quit":  # close every client, answer, and skip the slow interpreter teardown
            node.close_all()
            _send(stream, {"ok": True, "result": None})
            sys.stderr.flush()
            os._exit(0)
        try:
            if cmd not in table:
                raise ValueError(f"unknown command {cmd!r}")
            _send(stream, {"ok": True, "result": table[cmd](node, msg)})
        except Exception as e:  # noqa: BLE001 - every failure goes back to the commander
            logger.warning("command %s failed:\n%s", cmd, traceback.format_exc())
            _send(stream, {"ok": False, "error": f"{type(e).__name__}: {e}"})
    sock.close()
    return 0


def _send(stream: Any, obj: dict) -> None:
    stream.write(json.dumps(obj) + "\n")
    stream.flush()
