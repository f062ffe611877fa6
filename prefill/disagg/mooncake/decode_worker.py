"""The decode worker process
(``python -m hicache_prefill.prefill.disagg.mooncake.decode_worker``): a decode instance without a
model (``receiver.DecodeReceiver``) whose KV pool has ``--kv-geometry``, driven over
stdin/stdout as ``multiprocessing.connection`` byte messages. Each command is one JSON message
``{"op": ..., ...}``; each answer a JSON message echoing its ``seq`` and ``parts`` (then that
many raw tensor messages for ``received_kv``). The first message is ``{"ready": true, ...}``,
or ``{"ready": false, "error": ...}`` and a non-zero exit. It exits when stdin closes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from hicache_prefill.hicache.storage.mooncake.availability import require_loopback_engines
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry
from hicache_prefill.prefill.disagg.mooncake.receiver import DecodeConfig, DecodeReceiver


def send_message(conn: Connection, head: dict[str, Any], payload: Sequence[bytes] = ()) -> None:
    """``head`` (with ``parts``) and its raw payload messages."""
    conn.send_bytes(json.dumps({**head, "parts": len(payload)}).encode())
    for part in payload:
        conn.send_bytes(part)


def recv_message(conn: Connection) -> tuple[dict[str, Any], list[bytes]]:
    """One message from ``send_message``; ``EOFError`` when the other end closed."""
    head = json.loads(conn.recv_bytes())
    return head, [conn.recv_bytes() for _ in range(int(head.pop("parts", 0)))]


logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hicache_prefill.prefill.disagg.mooncake.decode_worker"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--max-total-tokens", type=int, default=1 << 16)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-geometry", required=True, help="KVGeometry JSON of the decode's pool")
    p.add_argument("--check-free-pages", action="store_true")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag for a size that is not positive or a missing device."""
    for flag in ("--max-total-tokens", "--max-running-requests"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {args.device}: this machine has {count} CUDA devices")
    elif device.type != "cpu":
        raise ValueError(f"--device {args.device}: only cpu and cuda devices are supported")


def handle(rx: DecodeReceiver, cmd: dict[str, Any]) -> list[bytes]:
    op = cmd.get("op")

    rid = cmd.get("rid")
    extra: list[bytes] = []
    out: dict[str, Any] = {"ok": True}
    if op == "add":
        rx.add(
            rid,
            int(cmd["room"]),
            cmd["bootstrap_addr"],
            int(cmd["num_tokens"]),
            int(cmd.get("decode_prefix_len", 0)),
            bool(cmd.get("keep", True)),
            bool(cmd.get("hold", False)),
            float(cmd.get("delay_s", 0.0)),
        )
    elif op == "unhold":
        rx.unhold(rid)
    elif op == "abort":
        rx.abort(rid)
    elif op == "release":
        rx.release(rid)
    elif op == "state":
        out.update(rx.state(rid))
    elif op == "received_kv":
        dpl, first, bufs = rx.received_kv(rid, bool(cmd.get("any_state", False)))
        out.update(
            decode_prefix_len=dpl,
            first_token=first,
            tensors=[
                {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in bufs
            ],
        )
        extra = [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in bufs]
    elif op == "stats":
        out.update(rx.stats())
    else:
        raise ValueError(f"unknown command {op!r}")
    return [json.dumps(out).encode(), *extra]


def serve(rx: DecodeReceiver, inp: Connection, out: Connection, ready: dict[str, Any]) -> None:
    send_message(out, ready)
    while True:
        try:
            cmd, _ = recv_message(inp)
        except (EOFError, OSError):
            return
        seq = cmd.get("seq") if isinstance(cmd, dict) else None
        try:
            if cmd.get("op") == "quit":
                send_message(out, {"ok": True, "seq": seq})
                return
            reply = handle(rx, cmd)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            reply = [json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()]
        head = json.loads(reply[0])
        head["seq"] = seq
        send_message(out, head, reply[1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s decode[%(process)d] %(levelname)s %(message)s",
    )
    # The protocol owns the original stdout; anything else written to fd 1 goes to stderr.
    proto_out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    proto_in = Connection(os.dup(0), writable=False)
    try:
        check_args(args)
        try:
            geometry = KVGeometry.from_json(args.kv_geometry)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--kv-geometry: {e}") from None
        require_loopback_engines(args.host)
        cfg = DecodeConfig.from_env(
            geometry=geometry,
            host=args.host,
            pool_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests,
            device=args.device,
            check_free_pages=args.check_free_pages,
        )
        rx = DecodeReceiver(cfg)
    except (ValueError, RuntimeError) as e:
        send_message(proto_out, {"ready": False, "error": str(e)})
        logger.error("decode worker cannot start: %s", e)
        return 2
    ready = {
        "ready": True,
        "pid": os.getpid(),
        "session": rx.engine.session_id,
        "control_port": rx.listener.port,
    }
    try:
        serve(rx, proto_in, proto_out, ready)
    finally:
        rx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
