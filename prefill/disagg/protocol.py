"""The decode-peer protocol the prefill executor talks to, whatever transport is behind it: a
``DecodeLink`` per request (SGLang's ``KVSender``: ``poll``, ``init``, ``send``) and the
``DecodeBackend`` behind them; the executor uses nothing else. Also ``KVPoll`` (ordered so a
MIN over ranks is the most pessimistic), ``SendRecord``, ``MetadataRow``, the checks every
link's ``init`` / ``send`` / ``create_peer`` make, and SGLang's environment knobs (bootstrap
timeout, force-not-ready test hook)."""

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
    """Log entry of one ``send``: who sent what, when."""

    rid: str
    attempt: int
    start: int
    end: int
    time: float
    last: bool


@dataclass(frozen=True)
class MetadataRow:
    """The request's metadata row, carried by its last send (SGLang's ``MetadataBuffers`` row
    at ``metadata_buffer_index``): the first output token and the prefix tokens prefill had
    cached. The transport adds the bootstrap room decode checks it against."""

    index: int
    first_token: int
    cached_tokens: int


class DecodeLink(Protocol):
    """The prefill side's end of one request's link to its decode peer (SGLang's sender).

    ``decode_prefix_len``: tokens decode already holds (page-aligned; sends start there);
    ``sent_end``: where the next send starts; ``failure``: why the link failed;
    ``timed_out``: it failed by the bootstrap timeout. Calls never block."""

    rid: str
    num_tokens: int
    decode_prefix_len: int
    finalized_attempt: int | None
    failure: str | None
    timed_out: bool

    @property
    def sent_end(self) -> int: ...

    def poll(self) -> KVPoll:
        """The current state (advancing any time-driven change first)."""
        ...

    def init(self, attempt: int) -> None:
        """Finalize: commit ``attempt`` as the one whose KV will be sent (SGLang's
        ``sender.init``, which carries the metadata). Only in ``WaitingForInput``, once."""
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
        """Queue the KV of tokens ``[start, end)`` held in prefill device slots ``src_slots``
        (int64, ``end - start`` entries); ranges are contiguous from ``decode_prefix_len``, and
        a non-last one ends on a page boundary. The last send carries ``metadata``. The slots
        are read later, until the send's ack (``inflight_reads``). False, queueing nothing,
        when the link has failed."""
        ...

    def inflight_reads(self) -> int:
        """Sends whose source slots may still be read: queued, or in a call that has not
        returned, also after the link failed (the executor frees their slots only at 0)."""
        ...

    def next_event_time(self) -> float | None:
        """When ``poll`` may next change on its own (``None``: no time-driven event ahead)."""
        ...

    def fail(self, reason: str) -> None:
        """Fail the link now (a decision of the prefill side, e.g. another TP rank's)."""
        ...

    @property
    def live(self) -> bool:
        """Neither ``Success`` nor ``Failed``."""
        ...


def check_new_link(
    old: DecodeLink | None, rid: str, num_tokens: int, token_ids: Sequence[int] | None
) -> None:
    """``create_peer``'s checks (``ValueError``): no live link under ``rid``, at least one token,
    one token id per token."""
    if old is not None and old.live:
        raise ValueError(f"rid {rid!r} already has a live decode peer")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if token_ids is not None and len(token_ids) != num_tokens:
        raise ValueError(f"token_ids has {len(token_ids)} entries, num_tokens is {num_tokens}")


def finalize(link: DecodeLink, attempt: int) -> None:
    """``init`` of every link: only in ``WaitingForInput``, once (``RuntimeError`` otherwise)."""
    state = link.poll()
    if state != KVPoll.WaitingForInput:
        raise RuntimeError(f"{link.rid}: init in state {state.name}")
    if link.finalized_attempt is not None:
        raise RuntimeError(f"{link.rid}: init called twice")
    link.finalized_attempt = attempt


def send_allowed(
    link: DecodeLink, attempt: int, start: int, end: int, src_slots: torch.Tensor
) -> bool:
    """The checks every link's ``send`` makes first: False when the link has failed;
    ``RuntimeError`` for a send the protocol never allows, ``ValueError`` for a range that does
    not continue at ``sent_end`` within the prompt or a slot count other than one per token."""
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

    def next_event_time(self) -> float | None:
        """Earliest ``next_event_time`` of the live links."""
        ...

    def release(self, rid: str) -> None:
        """Forget ``rid``'s received KV and link (idempotent)."""
        ...


BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
"""Upstream's environment variable for the bootstrap timeout in seconds."""

DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0
"""Upstream's default bootstrap timeout."""

FORCE_RETRY_ENV = "SGLANG_TEST_FORCE_OPTIMISTIC_PREFILL_RETRY_PROB"
"""Upstream's environment variable for the force-not-ready test hook."""


def positive_env(name: str, default: float, kind: type = float) -> float:
    """The environment variable ``name`` as a positive ``kind`` (``int`` or ``float``; returned
    as a ``float``), or ``default`` when it is unset. Raises ``ValueError`` naming the variable
    and its value when it is not one (SGLang's ``EnvInt`` / ``EnvFloat`` settings)."""
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
    """``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` in seconds (an integer, as upstream's
    ``EnvInt``), or the default 300. Raises ``ValueError`` naming the variable when it is not a
    positive integer."""
    return positive_env(BOOTSTRAP_TIMEOUT_ENV, DEFAULT_BOOTSTRAP_TIMEOUT_S, int)


def force_not_ready_prob(args: object) -> float:
    """The force-not-ready probability: ``--disaggregation-force-not-ready-prob``, overridden by
    ``SGLANG_TEST_FORCE_OPTIMISTIC_PREFILL_RETRY_PROB`` (upstream's test hook, with a trace)."""
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
