"""``--disaggregation-transfer-backend``: ``simulated`` (default, deterministic on the
executor's clock) or ``mooncake`` (the real transport, wall clock only)."""

from __future__ import annotations

from typing import Any

from hicache_prefill.hicache.memory.device_pool import KVPool
from hicache_prefill.prefill.disagg.protocol import DecodeBackend
from hicache_prefill.prefill.disagg.simulated import DecodeSide, PeerConfig

TRANSFER_BACKENDS = ("simulated", "mooncake")


def make_decode_backend(
    args: Any,
    pool: KVPool,
    clock: Any,
    metadata_size: int,
    decode_pool_size: int,
    keep_received: bool = False,
    peer_config: PeerConfig | None = None,
    send_log_size: int | None = 10_000,
) -> DecodeBackend:
    """The backend ``args`` names. ``metadata_size``: the executor's metadata rows (mooncake);
    ``decode_pool_size``, ``peer_config``: the simulation's; ``keep_received``: keep received KV
    (simulated) or the prompts (mooncake) for KV checks."""

    name = getattr(args, "disaggregation_transfer_backend", "simulated")
    if name == "simulated":
        cfg = peer_config if peer_config is not None else PeerConfig.from_server_args(args)
        return DecodeSide(
            pool,
            clock,
            cfg,
            size=decode_pool_size,
            keep_received=keep_received,
            send_log_size=send_log_size,
        )
    if name == "mooncake":
        from hicache_prefill.prefill.disagg.mooncake.link import MooncakeBackend, MooncakeConfig

        cfg = MooncakeConfig.from_server_args(args)
        return MooncakeBackend(
            pool,
            clock,
            cfg,
            metadata_size,
            keep_token_ids=keep_received,
            send_log_size=send_log_size,
        )
    raise ValueError(
        f"--disaggregation-transfer-backend {name!r}: choose one of {', '.join(TRANSFER_BACKENDS)}"
    )
