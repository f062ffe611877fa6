"""The decode-peer protocol the prefill executor talks to, whatever the transport: a
``DecodeLink`` per request (SGLang's ``KVSender``) and the ``DecodeBackend`` behind them, the
checks every link makes, and SGLang's environment knobs. ``KVPoll`` is ordered so a MIN over
ranks is the most pessimistic."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


class KVPoll(IntEnum):
    """Decode-peer states, as SGLang's ``disaggregation.base.conn.KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = (KVPoll.Success, KVPoll.Failed)


@dataclass(frozen=True)
class SendRecord:
    rid: str
    attempt: int
    start: int
    end: int
    time: float
    last: bool


@dataclass(frozen=True)
class MetadataRow:
    """The metadata row the last send carries (SGLang's ``MetadataBuffers`` row): the prefix
    cached, split by tier as SGLang's ``cached_tokens_device``, ``_host``, ``_storage`` (disjoint:
    host tokens that came from L3 count as storage)."""

    index: int
    first_token: int
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0

    @property
    def cached_tokens(self) -> int:
        """SGLang's ``cached_tokens``: the three tiers together."""
        return self.cached_device + self.cached_host + self.cached_storage


class DecodeLink(Protocol):
    """The prefill side's end of one request's link to its decode peer; calls never block.
    ``decode_prefix_len``: tokens decode already holds (page-aligned; sends start there)."""

    rid: str
    num_tokens: int
    decode_prefix_len: int
    finalized_attempt: int | None
    failure: str | None
    timed_out: bool

    @property
    def sent_end(self) -> int: ...

    def poll(self) -> KVPoll: ...

    def init(self, attempt: int) -> None:
        """Commit ``attempt`` as the one whose KV is sent; only in ``WaitingForInput``, once."""
        ...

    def send(
        self,
        attempt: int,
        start: int,
        end: int,
        src_slots: torch.Tensor,
        last: bool,
        metadata: MetadataRow | None = None,
    ) -> bool:
        """Queue tokens ``[start, end)`` held in ``src_slots``, read until the send's ack; a
        non-last range ends on a page boundary. False, queueing nothing, once failed."""
        ...

    def inflight_reads(self) -> int:
        """Sends whose source slots may still be read, also after failure (free them at 0)."""
        ...

    def next_event_time(self) -> float | None:
        """When ``poll`` may next change on its own (``None``: no time-driven event ahead)."""
        ...

    def fail(self, reason: str) -> None: ...

    @property
    def live(self) -> bool: ...


def check_new_link(
    old: DecodeLink | None, rid: str, num_tokens: int, token_ids: Sequence[int] | None
) -> None:
    """``create_peer``'s checks (``ValueError``)."""
    if old is not None and old.live:
        raise ValueError(f"rid {rid!r} already has a live decode peer")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if token_ids is not None and len(token_ids) != num_tokens:
        raise ValueError(f"token_ids has {len(token_ids)} entries, num_tokens is {num_tokens}")


def finalize(link: DecodeLink, attempt: int) -> None:
    """``init`` of every link (``RuntimeError`` outside ``WaitingForInput`` or twice)."""
    state = link.poll()
    if state != KVPoll.WaitingForInput:
        raise RuntimeError(f"{link.rid}: init in state {state.name}")
    if link.finalized_attempt is not None:
        raise RuntimeError(f"{link.rid}: init called twice")
    link.finalized_attempt = attempt


def send_allowed(
    link: DecodeLink, attempt: int, start: int, end: int, src_slots: torch.Tensor
) -> bool:
    """``send``'s checks: False once failed; ``RuntimeError`` for a send the protocol never
    allows, ``ValueError`` for a range not continuing at ``sent_end`` or a wrong slot count."""
    state = link.poll()
    if state == KVPoll.Failed:
        return False
    if link.finalized_attempt != attempt:
        raise RuntimeError(
            f"{link.rid}: send for attempt {attempt}, finalized {link.finalized_attempt}"
        )
    if state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
        raise RuntimeError(f"{link.rid}: send in state {state.name}")
    expected = link.sent_end
    if start != expected or end < start or end > link.num_tokens:
        raise ValueError(f"{link.rid}: send range [{start}, {end}), expected start {expected}")
    if src_slots.numel() != end - start:
        raise ValueError(f"src_slots has {src_slots.numel()} entries for {end - start} tokens")
    return True


class DecodeBackend(Protocol):
    """The decode instance as the executor sees it: one link per request."""

    clock: object  # the clock its links read (the executor's)
    force_not_ready_prob: float  # SGLang's force-retry test hook, applied by the prefill side

    def create_peer(
        self, rid: str, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> DecodeLink:
        """A new link for ``rid`` (``ValueError`` if ``rid`` still has a live one)."""
        ...

    def next_event_time(self) -> float | None: ...

    def release(self, rid: str) -> None:
        """Forget ``rid``'s received KV and link (idempotent)."""
        ...


BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0
FORCE_RETRY_ENV = "SGLANG_TEST_FORCE_OPTIMISTIC_PREFILL_RETRY_PROB"


def positive_env(name: str, default: float, kind: type = float) -> float:
    """``name`` as a positive ``kind`` (as a float), ``default`` when unset; ``ValueError``
    naming the variable otherwise (SGLang's ``EnvInt`` / ``EnvFloat``)."""
    raw = os.environ.get(name)
    if raw is None:
        return float(default)
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        what = "integer" if kind is int else "number"
        raise ValueError(f"{name}={raw!r} must be a positive {what} (seconds or a count)")
    return float(value)


def bootstrap_timeout_from_env() -> float:
    """The bootstrap timeout in seconds (a positive integer, default 300)."""
    return positive_env(BOOTSTRAP_TIMEOUT_ENV, DEFAULT_BOOTSTRAP_TIMEOUT_S, int)


def force_not_ready_prob(args: object) -> float:
    """``--disaggregation-force-not-ready-prob``, overridden by ``FORCE_RETRY_ENV``."""

    prob = float(getattr(args, "disaggregation_force_not_ready_prob", 0) or 0)
    env = os.environ.get(FORCE_RETRY_ENV)
    if env is not None:
        logger.warning(
            "%s=%s overrides the force-not-ready probability %s", FORCE_RETRY_ENV, env, prob
        )
        prob = float(env)
    return prob


def force_not_ready(rid: str, prob: float) -> bool:
    """Deterministic per-rid coin of probability ``prob`` (upstream ``should_force_retry``)."""
    if prob <= 0:
        return False
    digest = hashlib.sha256(str(rid).encode()).digest()
    return int.from_bytes(digest[:8], "big") < prob * 2**64
