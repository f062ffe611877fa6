"""SGLang 0.5.23's Mooncake PD control messages, frame for frame (``mooncake/conn.py``,
``common/conn.py``): REGISTER (20 frames, room ``"None"``), META (``TransferInfo``, 10), STATUS
(``[room, status, rank]``), ABORT (2, 4 or 5) and ABORT_ACK (2, 3 or 4). Ascii integers, packed
little-endian u64 pointers and item lengths, int32 page ids. A message that does not parse raises
``ControlMessageError`` naming the message and field. The sockets that carry them (ZMQ PUSH ->
PULL multipart, as SGLang) are in ``channel``."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ABORT_TAG = b"ABORT"
ABORT_ACK_TAG = b"ABORT_ACK"
REGISTER_ROOM = b"None"
REGISTER_FRAMES = 20
META_FRAMES = 10
MAX_FRAMES = 32
"""Frames of one message past which the control plane drops it (SGLang's longest has 20)."""
MAX_LIST = 4096
"""Entries of a packed pointer or length list (a model's layer buffers, metadata buffers)."""
MAX_META_PAGES = 1 << 20
"""Destination pages of one META (1M pages: 16M tokens at page 16), refused past it before
they are unpacked."""


class ControlMessageError(ValueError):
    """A control message that does not parse (the message names what was wrong)."""


def _a(x: object) -> bytes:
    return str(x).encode("ascii")


def _frame(frames: Sequence[bytes], i: int, msg: str, field: str) -> bytes:
    if i >= len(frames):
        raise ControlMessageError(f"{msg}: {field} (frame {i}) is missing")
    return bytes(frames[i])


def _int(frames: Sequence[bytes], i: int, msg: str, field: str, default: int | None = None) -> int:
    raw = frames[i] if i < len(frames) else b""
    if raw == b"" and default is not None:
        return default
    try:
        return int(bytes(raw).decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ControlMessageError(
            f"{msg}: {field} must be an integer, got {bytes(raw)[:32]!r}"
        ) from None


def _str(frames: Sequence[bytes], i: int, msg: str, field: str) -> str:
    try:
        return _frame(frames, i, msg, field).decode("ascii")
    except UnicodeDecodeError:
        raise ControlMessageError(f"{msg}: {field} is not ascii") from None


def _packed(frames: Sequence[bytes], i: int, msg: str, field: str, fmt: str) -> tuple[int, ...]:
    raw = frames[i] if i < len(frames) else b""
    width = struct.calcsize(fmt)
    if len(raw) % width:
        raise ControlMessageError(f"{msg}: {field} must be packed {fmt} values")
    if len(raw) // width > MAX_LIST:
        raise ControlMessageError(
            f"{msg}: {field} has {len(raw) // width} entries (at most {MAX_LIST})"
        )
    return struct.unpack(f"<{len(raw) // width}{fmt}", bytes(raw))


def _pack(values: Sequence[int], fmt: str) -> bytes:
    return struct.pack(f"<{len(values)}{fmt}", *values)


def _packed_lists(frames: Sequence[bytes], i: int) -> bytes:
    return bytes(frames[i]) if i < len(frames) else b""


@dataclass(frozen=True)
class Register:
    """Decode -> prefill, once per (prefill rank, decode rank): SGLang's ``KVArgsRegisterInfo``.
    ``kv_ptrs``: one per layer buffer (K layers then V layers, or MLA's latent);
    ``kv_item_lens``: bytes of one page of each; ``aux_ptrs``: the metadata buffers in SGLang's
    order. The state, staging and DCP fields are carried as raw frames (the project sends them
    empty / ``1, 0``); ``extra`` names what a peer set that this side cannot serve."""

    decode_ip: str
    decode_port: int
    session: str
    kv_ptrs: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    tp_rank: int = 0
    attn_tp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0
    state_ptrs: bytes = b""
    kv_layer_ids: tuple[int, ...] = ()
    staging_base: int = 0
    staging_size: int = 0

    def to_frames(self) -> list[bytes]:
        return [
            REGISTER_ROOM,
            _a(self.decode_ip),
            _a(self.decode_port),
            _a(self.session),
            _pack(self.kv_ptrs, "Q"),
            _pack(self.aux_ptrs, "Q"),
            self.state_ptrs,
            _a(self.tp_rank),
            _a(self.attn_tp_size),
            _a(self.kv_item_lens[0] if self.kv_item_lens else 0),
            b"",  # state item lens
            b"",  # state dims per tensor
            _pack(self.kv_layer_ids, "I"),
            b"",  # state layer ids
            _pack([self.staging_base], "Q") if self.staging_base else b"",
            _a(self.staging_size) if self.staging_size else b"",
            _a(self.dcp_size),
            _a(self.dcp_rank),
            b"",  # staging slot layer ids
            _pack(self.kv_item_lens, "Q"),
        ]

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> Register:
        """SGLang's parse: frames past 9 are optional (older peers send fewer); without frame
        19 every buffer has frame 9's item length."""
        m = "REGISTER"
        if len(frames) < 10:
            raise ControlMessageError(f"{m}: {len(frames)} frames, expected {REGISTER_FRAMES}")
        kv_ptrs = _packed(frames, 4, m, "kv_data_ptrs", "Q")
        item_len = _int(frames, 9, m, "kv_item_len")
        lens = _packed(frames, 19, m, "kv_item_lens", "Q") or (item_len,) * len(kv_ptrs)
        if len(lens) != len(kv_ptrs):
            raise ControlMessageError(f"{m}: {len(kv_ptrs)} kv ptrs but {len(lens)} item lens")
        staging = _packed(frames, 14, m, "staging base", "Q") if len(frames) > 14 else ()
        return cls(
            decode_ip=_str(frames, 1, m, "decode ip"),
            decode_port=_int(frames, 2, m, "decode port"),
            session=_str(frames, 3, m, "session id"),
            kv_ptrs=kv_ptrs,
            aux_ptrs=_packed(frames, 5, m, "aux_data_ptrs", "Q"),
            kv_item_lens=lens,
            tp_rank=_int(frames, 7, m, "tp rank"),
            attn_tp_size=_int(frames, 8, m, "attn tp size"),
            dcp_size=_int(frames, 16, m, "dcp size", default=1),
            dcp_rank=_int(frames, 17, m, "dcp rank", default=0),
            state_ptrs=_packed_lists(frames, 6),
            kv_layer_ids=_packed(frames, 12, m, "kv layer ids", "I"),
            staging_base=staging[0] if staging else 0,
            staging_size=_int(frames, 15, m, "staging size", default=0),
        )


@dataclass(frozen=True)
class Meta:
    """Decode -> prefill, per request and prefill rank (SGLang's ``TransferInfo``): the int32
    page ids of tokens ``[decode_prefix_len, n)`` and the metadata row. A dummy rank's META
    (MLA with a larger prefill TP) has empty page and row frames: ``dummy``."""

    room: int
    decode_ip: str
    decode_port: int
    session: str
    dst_pages: tuple[int, ...]
    dst_aux_index: int
    decode_prefix_len: int
    required_dst_info_num: int = 1
    dummy: bool = False
    state_indices: bytes = b""
    device_pages: bytes = b""

    def to_frames(self) -> list[bytes]:
        return [
            _a(self.room),
            _a(self.decode_ip),
            _a(self.decode_port),
            _a(self.session),
            b"" if self.dummy else np.asarray(self.dst_pages, dtype="<i4").tobytes(),
            b"" if self.dummy else _a(self.dst_aux_index),
            b"" if self.dummy else self.state_indices,
            _a(self.required_dst_info_num),
            _a(self.decode_prefix_len),
            b"" if self.dummy else self.device_pages,
        ]

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> Meta:
        m = "META"
        if len(frames) < 8:
            raise ControlMessageError(f"{m}: {len(frames)} frames, expected {META_FRAMES}")
        room = _int(frames, 0, m, "room")
        dummy = frames[4] == b"" and frames[5] == b""
        if len(frames[4]) % 4:
            raise ControlMessageError(f"{m}: destination page ids must be packed int32")
        if len(frames[4]) // 4 > MAX_META_PAGES:
            raise ControlMessageError(
                f"{m}: {len(frames[4]) // 4} destination pages (at most {MAX_META_PAGES})"
            )
        pages = () if dummy else tuple(np.frombuffer(bytes(frames[4]), dtype="<i4").tolist())
        return cls(
            room=room,
            decode_ip=_str(frames, 1, m, "decode ip"),
            decode_port=_int(frames, 2, m, "decode port"),
            session=_str(frames, 3, m, "session id"),
            dst_pages=pages,
            dst_aux_index=-1 if dummy else _int(frames, 5, m, "dst aux index"),
            required_dst_info_num=_int(frames, 7, m, "required_dst_info_num"),
            decode_prefix_len=_int(frames, 8, m, "decode_prefix_len", default=0),
            dummy=dummy,
            state_indices=b"" if dummy else _packed_lists(frames, 6),
            device_pages=_packed_lists(frames, 9),
        )


@dataclass(frozen=True)
class Abort:
    """Decode -> prefill: decode gave up on ``room``. With ``generation`` (SGLang's deferred
    decode KV release) the prefill acks once nothing can write the room's pages; without one it
    does not ack (as SGLang's prefill)."""

    room: int
    decode_ip: str | None = None
    decode_port: int | None = None
    generation: int | None = None

    def to_frames(self) -> list[bytes]:
        frames = [ABORT_TAG, _a(self.room)]
        if self.decode_ip is not None and self.decode_port is not None:
            frames += [_a(self.decode_ip), _a(self.decode_port)]
            if self.generation is not None:
                frames.append(_a(self.generation))
        return frames

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> Abort:
        m = "ABORT"
        if len(frames) < 2:
            raise ControlMessageError(f"{m}: {len(frames)} frames, expected 2, 4 or 5")
        room = _int(frames, 1, m, "room")
        if len(frames) < 4:
            return cls(room)
        generation = _int(frames, 4, m, "generation") if len(frames) > 4 else None
        return cls(room, _str(frames, 2, m, "decode ip"), _int(frames, 3, m, "decode port"),
                   generation)  # fmt: skip

    @property
    def endpoint(self) -> tuple[str, int] | None:
        if self.decode_ip is None or self.decode_port is None:
            return None
        return self.decode_ip, self.decode_port


@dataclass(frozen=True)
class Status:
    """Prefill -> decode: ``room`` reached ``status`` (a ``KVPoll`` value) on prefill rank
    ``rank`` (SGLang's Mooncake STATUS: no tag, no reason frame)."""

    room: int
    status: int
    rank: int = 0

    def to_frames(self) -> list[bytes]:
        return [_a(self.room), _a(self.status), _a(self.rank)]

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> Status:
        m = "STATUS"
        if len(frames) < 3:
            raise ControlMessageError(f"{m}: {len(frames)} frames, expected 3")
        status = _int(frames, 1, m, "status")
        if not 0 <= status <= 4:
            raise ControlMessageError(f"{m}: status {status} is not a KVPoll value")
        return cls(_int(frames, 0, m, "room"), status, _int(frames, 2, m, "rank"))


@dataclass(frozen=True)
class AbortAck:
    """Prefill -> decode: no engine call can write ``room``'s pages any more (``generation``
    echoes the ABORT's)."""

    room: int
    rank: int = 0
    generation: int | None = None

    def to_frames(self) -> list[bytes]:
        frames = [ABORT_ACK_TAG, _a(self.room), _a(self.rank)]
        if self.generation is not None:
            frames.append(_a(self.generation))
        return frames

    @classmethod
    def from_frames(cls, frames: Sequence[bytes]) -> AbortAck:
        m = "ABORT_ACK"
        if len(frames) < 3:
            raise ControlMessageError(f"{m}: {len(frames)} frames, expected 3 or 4")
        generation = _int(frames, 3, m, "generation") if len(frames) > 3 else None
        return cls(_int(frames, 1, m, "room"), _int(frames, 2, m, "rank"), generation)


def parse_to_prefill(frames: Sequence[bytes]) -> Register | Meta | Abort:
    """What a prefill rank's PULL socket receives, told apart by the first frame as SGLang's
    bootstrap thread does."""
    if not frames:
        raise ControlMessageError("an empty message")
    if frames[0] == ABORT_TAG:
        return Abort.from_frames(frames)
    if frames[0] == REGISTER_ROOM:
        return Register.from_frames(frames)
    if frames[0] in (b"BOOTSTRAP", b"WATERMARK", b"STAGING_RSP"):
        raise ControlMessageError(
            f"{bytes(frames[0]).decode()}: not served (decode allocation policy 'early', no "
            "staging buffer)"
        )
    return Meta.from_frames(frames)


def parse_to_decode(frames: Sequence[bytes]) -> Status | AbortAck:
    """What a decode rank's PULL socket receives."""
    if not frames:
        raise ControlMessageError("an empty message")
    if frames[0] == ABORT_ACK_TAG:
        return AbortAck.from_frames(frames)
    return Status.from_frames(frames)
