"""The decode worker process
(``python -m hicache_prefill.prefill.disagg.mooncake.decode_worker``): a decode instance without a
model (``receiver.DecodeReceiver``), driven over stdin/stdout. Each command is
a framed message whose first frame is JSON ``{"op": ..., ...}``; each answer a JSON frame echoing
its ``seq``, then raw tensor frames for ``received_kv``. The first message is ``{"ready": true,
...}``, or ``{"ready": false, "error": ...}`` and a non-zero exit. It exits when stdin closes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, BinaryIO

import torch

from hicache_prefill.hicache.storage.mooncake.availability import require_loopback_engines
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry
from hicache_prefill.prefill.disagg.mooncake.receiver import DecodeConfig, DecodeReceiver
from hicache_prefill.prefill.disagg.mooncake.wire import read_stream, write_stream

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hicache_prefill.prefill.disagg.mooncake.decode_worker"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--max-total-tokens", type=int, default=1 << 16)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--expect-geometry", default=None, help="KVGeometry JSON")
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


def serve(rx: DecodeReceiver, inp: BinaryIO, out: BinaryIO, ready: dict[str, Any]) -> None:
    write_stream(out, [json.dumps(ready).encode()])
    while True:
        try:
            frames = read_stream(inp)
        except EOFError:
            return
        seq = None
        try:
            cmd = json.loads(frames[0])
            seq = cmd.get("seq")
            if cmd.get("op") == "quit":
                write_stream(out, [json.dumps({"ok": True, "seq": seq}).encode()])
                return
            reply = handle(rx, cmd)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            reply = [json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()]
        head = json.loads(reply[0])
        head["seq"] = seq
        write_stream(out, [json.dumps(head).encode(), *reply[1:]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s decode[%(process)d] %(levelname)s %(message)s",
    )
    # The protocol owns the original stdout; anything else written to fd 1 goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        check_args(args)
        expect = KVGeometry.from_json(args.expect_geometry) if args.expect_geometry else None
        require_loopback_engines(args.host)
        cfg = DecodeConfig.from_env(
            host=args.host,
            pool_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests,
            device=args.device,
            expect_geometry=expect,
            check_free_pages=args.check_free_pages,
        )
        rx = DecodeReceiver(cfg)
    except (ValueError, RuntimeError) as e:
        write_stream(proto_out, [json.dumps({"ready": False, "error": str(e)}).encode()])
        logger.error("decode worker cannot start: %s", e)
        return 2
    ready = {
        "ready": True,
        "pid": os.getpid(),
        "session": rx.engine.session_id,
        "control_port": rx.listener.port,
    }
    try:
        serve(rx, sys.stdin.buffer, proto_out, ready)
    finally:
        rx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
