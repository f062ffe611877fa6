"""Building blocks shared by the executor's tests and benchmarks: an executor wired to a
virtual (or wall) clock and a decode side that keeps what it received, and the check that a
request's decode-side KV equals a full recompute.

The decode side is the one ``--disaggregation-transfer-backend`` names: the in-process
simulation (``simulated``, default), or decode worker processes reached over Mooncake
(``mooncake``: ``tests.support.mooncake_decode.MooncakeDecode``, wall clock only; call
``executor.decode.close()`` when done)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hicache_prefill.prefill.clock import Clock, VirtualClock, WallClock
from hicache_prefill.prefill.disagg.backends import make_decode_backend
from hicache_prefill.prefill.disagg.simulated import DEFAULT_SEND_LOG_SIZE, PeerConfig
from hicache_prefill.prefill.executor import CostModel, OptimisticPrefillExecutor
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.model.paged import PagedTransformer
from hicache_prefill.prefill.scheduler.admission import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    metadata_buffer_count,
)
from hicache_prefill.prefill.tp_lockstep.driver import agreed_clock

if TYPE_CHECKING:
    from hicache_prefill.hicache.tp.group import TPGroup

logger = logging.getLogger(__name__)

KV_ATOL = 1e-5
"""fp32 tolerance of decode-side KV vs a full recompute (matmul reduction order only)."""


def build_cache(
    args: Any,
    copy_delay: float | Callable[[], float] = 0.0,
    group: TPGroup | None = None,
    streams: str | None = None,
) -> Any:
    """``hicache.builder.build_kv_cache(args, group=group, streams=streams)``; ``copy_delay``
    (CPU only, seconds or a callable) is slept before every copy on the controller's side
    streams, to widen race windows; ``streams``: a CPU stream mode (``"thread"``, ``"inline"``)
    or ``None`` for the device's default."""
    from hicache_prefill.hicache.builder import build_kv_cache

    return build_kv_cache(args, copy_delay=copy_delay, group=group, streams=streams)


def make_executor(
    args: Any,
    peer_config: PeerConfig | None = None,
    clock: Clock | None = None,
    cost_model: CostModel | None = None,
    keep_received: bool = True,
    decode_pool_size: int = 1 << 16,
    cache: Any = None,
    model: PagedTransformer | None = None,
    send_log_size: int | None = DEFAULT_SEND_LOG_SIZE,
    group: TPGroup | None = None,
    decode_workers: int | Sequence[Any] = 1,
    worker_options: dict[str, Any] | None = None,
    streams: str | None = None,
) -> OptimisticPrefillExecutor:
    """An executor over ``build_kv_cache(args)`` and the model of ``args``, with a decode side
    that keeps received KV (for ``assert_decode_kv_matches``; ``decode.release(rid)`` frees it)
    and a ``VirtualClock`` default. ``send_log_size``: sends the decode side remembers
    (``None``: all). ``group``: the tensor-parallel cache group, when ``cache`` is not given
    (the cache's otherwise); with more than one rank the clock becomes an ``AgreedClock`` and
    the model, when not given, this rank's ``TPPagedTransformer``. ``streams``: the CPU stream
    mode of the cache built here (``build_cache``).

    With ``--disaggregation-transfer-backend mooncake`` the clock defaults to a ``WallClock``
    (a virtual one raises ``ValueError``) and ``decode_workers`` decode worker processes are
    started (``worker_options``: ``DecodeWorker`` arguments such as ``pool_tokens``; their pool
    defaults to ``decode_pool_size`` tokens of the prefill pool's geometry), or the given
    ``DecodeWorker`` objects are used (not stopped by ``decode.close()``);
    ``peer_config.decode_prefix_len`` applies to them too."""
    mooncake = getattr(args, "disaggregation_transfer_backend", "simulated") == "mooncake"
    if clock is None:
        clock = WallClock() if mooncake else VirtualClock()
    cache = cache if cache is not None else build_cache(args, group=group, streams=streams)
    group = getattr(cache, "group", None)
    if group is not None:
        clock = agreed_clock(clock, group, None)
    if model is None:
        model = build_model(args)
    peer_config = peer_config if peer_config is not None else PeerConfig.from_server_args(args)
    mrr = getattr(args, "max_running_requests", None) or DEFAULT_MAX_RUNNING_REQUESTS
    decode = make_decode_backend(
        args, cache.device_pool, clock, metadata_buffer_count(mrr), decode_pool_size,
        keep_received=keep_received, peer_config=peer_config, send_log_size=send_log_size,
    )  # fmt: skip
    if mooncake:
        from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry
        from tests.support.mooncake_decode import MooncakeDecode, start_workers

        if isinstance(decode_workers, int):
            opts = {
                "pool_tokens": decode_pool_size,
                "geometry": KVGeometry.from_pool(cache.device_pool),
                **(worker_options or {}),
            }
            try:
                workers = start_workers(decode_workers, **opts)
            except BaseException:
                decode.close()
                raise
            owned = workers
        else:
            workers, owned = list(decode_workers), []
        decode = MooncakeDecode(
            decode,
            workers,
            keep_received=keep_received,
            decode_prefix_len=peer_config.decode_prefix_len,
            owned=owned,
        )
    return OptimisticPrefillExecutor(
        args,
        cache=cache,
        model=model,
        clock=clock,
        decode=decode,
        cost_model=cost_model,
    )


def decode_kv_and_reference(
    executor: OptimisticPrefillExecutor, rid: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(got, ref), ...]``, one pair per pool buffer: the decode-side KV of ``rid`` (tokens
    ``[decode_prefix_len, n)``, ``[L, n', ...]``) and the model's full recompute of the same
    tokens (the prompt the decode peer was given), in the KV dtype. MHA: ``[(k, ref_k), (v,
    ref_v)]``, ``[L, n', H, D]``; MLA: ``[(kv, ref_kv)]``, the latent and rotary key ``[L, n', 1,
    C]`` (the reference computed in the absorbed form, ``prefill.model.mla``). Valid after
    ``Success`` until ``decode.release(rid)``, whether or not the result was popped."""
    dpl, *got = executor.decode.received_kv(rid)
    token_ids = executor.decode.peers[rid].token_ids
    if token_ids is None:
        raise ValueError(f"rid {rid!r}: the decode side was built without keep_received")
    ids = torch.tensor(token_ids, dtype=torch.int64)
    _, *ref = executor.model.forward_reference(ids)
    if len(ref) != len(got):
        raise ValueError(
            f"rid {rid!r}: the decode pool holds {len(got)} buffers, the model caches {len(ref)}"
        )
    return [(g, r[:, dpl:].to(g.dtype)) for g, r in zip(got, ref, strict=True)]


def kv_max_rel_error(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Largest relative L2 error of one (layer, token) row of any buffer (K, V or MLA's latent):
    ``|got - ref| / |ref|``.

    bf16 rounding noise of a chunked prefill against a full recompute grows with depth but
    stays at a few percent (measured ~3% after 32 layers); KV read from a wrong or reused slot
    is unrelated data, an error near 1 or above."""
    worst = 0.0
    for got, ref in pairs:
        g, r = got.float().flatten(2), ref.float().flatten(2)
        err = (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)
        if err.numel():
            worst = max(worst, float(err.max()))
    return worst


def assert_decode_kv_matches(
    executor: OptimisticPrefillExecutor, rid: str, atol: float = KV_ATOL
) -> None:
    """Decode-side KV of ``rid`` (tokens ``[decode_prefix_len, n)``, every layer, every buffer:
    K and V, or MLA's latent) equals the model's full recompute of the prompt within
    ``atol``."""
    for got, ref in decode_kv_and_reference(executor, rid):
        torch.testing.assert_close(got, ref, atol=atol, rtol=atol)


def single_torch_thread() -> Any:
    """Context manager: ``torch.set_num_threads(1)`` inside, the previous count restored after.

    The tiny model's ops are far too small for intra-op threads; on a loaded 2-core machine
    OpenMP spinning made them ~20x slower (measured: 1.6 ms vs 27 ms CPU per forward)."""
    from contextlib import contextmanager

    @contextmanager
    def _cm():  # type: ignore[no-untyped-def]
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return _cm()
