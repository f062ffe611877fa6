"""Control messages between the prefill and decode sides (SGLang 0.5.23's REGISTER, META, ABORT,
STATUS, ABORT_ACK, with its frame order), their framing over plain TCP
(``[u32 frame count]([u32 length][bytes])*``, big-endian, instead of ZMQ), and the sockets that
carry them (``Pusher``, ``Listener``). A message that does not parse raises
``ControlMessageError`` naming the message and field; the listener counts it and keeps serving."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

logger = logging.getLogger(__name__)

MAX_FRAMES = 64
MAX_FRAME_BYTES = 256 << 20
ABORT_TAG = b"ABORT"
ABORT_ACK_TAG = b"ABORT_ACK"
REGISTER_ROOM = b"None"


class ControlMessageError(ValueError):
    """A control message that does not parse (the message names what was wrong)."""


def encode_frames(frames: Sequence[bytes]) -> bytes:
    parts = [struct.pack("!I", len(frames))]
    for f in frames:
        parts += [struct.pack("!I", len(f)), bytes(f)]
    return b"".join(parts)


def _read_exact(read: Callable[[int], bytes], n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = read(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def read_frames(read: Callable[[int], bytes]) -> list[bytes]:
    """One message from a byte source (``sock.recv`` or ``stream.read``). ``EOFError`` at a
    clean end, ``ControlMessageError`` for a frame count or length past the limits."""
    (count,) = struct.unpack("!I", _read_exact(read, 4))
    if count > MAX_FRAMES:
        raise ControlMessageError(f"{count} frames in one message (at most {MAX_FRAMES})")
    frames = []
    for _ in range(count):
        (n,) = struct.unpack("!I", _read_exact(read, 4))
        if n > MAX_FRAME_BYTES:
            raise ControlMessageError(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
        frames.append(_read_exact(read, n))
    return frames


def write_stream(stream: BinaryIO, frames: Sequence[bytes]) -> None:
    stream.write(encode_frames(frames))
    stream.flush()


def read_stream(stream: BinaryIO) -> list[bytes]:
    return read_frames(stream.read)


class Listener:
    """A TCP listener on ``(host, 0)``; every message of every connection goes to
    ``handler(frames)`` on that connection's thread. A handler's ``ControlMessageError`` is
    logged and counted in ``malformed``; the connection stays open."""

    def __init__(self, host: str, handler: Callable[[list[bytes]], None], name: str) -> None:
        self.handler = handler
        self.name = name
        self.malformed = 0
        self.last_error: str | None = None
        self._sock = socket.create_server((host, 0), backlog=128)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name=self.name, daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = conn.getpeername()
        with conn:
            while not self._closed:
                try:
                    frames = read_frames(conn.recv)
                except (EOFError, OSError):
                    return
                except ControlMessageError as e:  # framing broken: this connection is unusable
                    self._malformed(peer, e)
                    return
                try:
                    self.handler(frames)
                except ControlMessageError as e:
                    self._malformed(peer, e)

    def _malformed(self, peer: object, e: Exception) -> None:
        self.malformed += 1
        self.last_error = str(e)
        logger.error("%s: malformed control message from %s: %s", self.name, peer, e)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class Pusher:
    """One-way pushes to ``(ip, port)`` endpoints over cached connections (SGLang's PUSH
    sockets). ``push`` never raises: it returns whether the message was handed to the kernel
    (which, as with ZMQ, does not prove a dead peer read it)."""

    def __init__(self, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()

    def push(self, endpoint: tuple[str, int], frames: Sequence[bytes]) -> bool:
        data = encode_frames(frames)
        with self._lock:
            for _ in range(2):  # a cached connection may be stale: one fresh retry
                conn = self._conns.get(endpoint)
                try:
                    if conn is None:
                        conn = socket.create_connection(endpoint, timeout=self.timeout_s)
                        self._conns[endpoint] = conn
                    conn.sendall(data)
                    return True
                except OSError as e:
                    logger.debug("push to %s failed: %s", endpoint, e)
                    self._drop(endpoint)
            return False

    def _drop(self, endpoint: tuple[str, int]) -> None:
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            for endpoint in list(self._conns):
                self._drop(endpoint)


def _a(x: object) -> bytes:
    return str(x).encode("ascii")


def _int(frames: list[bytes], i: int, msg: str, field: str) -> int:
    try:
        return int(frames[i].decode("ascii"))
    except (IndexError, UnicodeDecodeError, ValueError):
        got = frames[i][:32] if i < len(frames) else "nothing"
        raise ControlMessageError(f"{msg}: {field} must be an integer, got {got!r}") from None


def _str(frames: list[bytes], i: int, msg: str, field: str) -> str:
    try:
        return frames[i].decode("ascii")
    except (IndexError, UnicodeDecodeError):
        raise ControlMessageError(f"{msg}: {field} is missing or not ascii") from None


def _u64s(frames: list[bytes], i: int, msg: str, field: str) -> tuple[int, ...]:
    if i >= len(frames) or len(frames[i]) % 8:
        raise ControlMessageError(f"{msg}: {field} must be packed u64 values")
    return tuple(int(x) for x in np.frombuffer(frames[i], dtype="<u8"))


def _u64_bytes(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def _count(frames: list[bytes], n: int, msg: str) -> None:
    if len(frames) != n:
        raise ControlMessageError(f"{msg}: {len(frames)} frames, expected {n}")


@dataclass(frozen=True)
class Register:
    """Decode -> prefill, once per decode session and prefill rank: where decode's KV and aux
    rows are (``kv_ptrs``: one per layer buffer, K layers then V layers, or MLA's latent)."""

    decode_ip: str
    decode_port: int
    session: str
    kv_ptrs: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    aux_row_lens: tuple[int, ...]
    geometry: str  # KVGeometry JSON
    tp_rank: int = 0
    attn_tp_size: int = 1

    def to_frames(self) -> list[bytes]:
        return [
            REGISTER_ROOM,
            _a(self.decode_ip),
            _a(self.decode_port),
            _a(self.session),
            _u64_bytes(self.kv_ptrs),
            _u64_bytes(self.aux_ptrs),
            b"",
            _a(self.tp_rank),
            _a(self.attn_tp_size),
            _a(self.kv_item_lens[0] if self.kv_item_lens else 0),
            _u64_bytes(self.kv_item_lens),
            _u64_bytes(self.aux_row_lens),
            self.geometry.encode(),
        ]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Register:
        m = "REGISTER"
        _count(frames, 13, m)
        kv_ptrs = _u64s(frames, 4, m, "kv_data_ptrs")
        lens = _u64s(frames, 10, m, "kv_item_lens")
        if len(lens) != len(kv_ptrs):
            raise ControlMessageError(f"{m}: {len(kv_ptrs)} kv ptrs but {len(lens)} item lens")
        aux = _u64s(frames, 5, m, "aux_data_ptrs")
        aux_lens = _u64s(frames, 11, m, "aux_row_lens")
        if len(aux) != len(aux_lens):
            raise ControlMessageError(f"{m}: {len(aux)} aux ptrs but {len(aux_lens)} row lens")
        try:
            geometry = frames[12].decode()
            json.loads(geometry)
        except (UnicodeDecodeError, ValueError):
            raise ControlMessageError(f"{m}: geometry is not JSON") from None
        return cls(
            decode_ip=_str(frames, 1, m, "decode ip"),
            decode_port=_int(frames, 2, m, "port"),
            session=_str(frames, 3, m, "session id"),
            kv_ptrs=kv_ptrs,
            aux_ptrs=aux,
            kv_item_lens=lens,
            aux_row_lens=aux_lens,
            geometry=geometry,
            tp_rank=_int(frames, 7, m, "tp rank"),
            attn_tp_size=_int(frames, 8, m, "tp size"),
        )


@dataclass(frozen=True)
class Meta:
    """Decode -> prefill, per request (SGLang's ``TransferInfo``): the destination pages of tokens
    ``[decode_prefix_len, n)`` and the destination metadata (aux) row."""

    room: int
    decode_ip: str
    decode_port: int
    session: str
    dst_pages: tuple[int, ...]
    dst_aux_index: int
    decode_prefix_len: int
    required_dst_info_num: int = 1

    def to_frames(self) -> list[bytes]:
        return [
            _a(self.room),
            _a(self.decode_ip),
            _a(self.decode_port),
            _a(self.session),
            np.asarray(self.dst_pages, dtype=np.int32).tobytes(),
            _a(self.dst_aux_index),
            b"",
            _a(self.required_dst_info_num),
            _a(self.decode_prefix_len),
        ]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Meta:
        m = "META"
        _count(frames, 9, m)
        if len(frames[4]) % 4:
            raise ControlMessageError(f"{m}: destination page ids must be packed int32")
        pages = tuple(int(x) for x in np.frombuffer(frames[4], dtype=np.int32))
        return cls(
            room=_int(frames, 0, m, "room"),
            decode_ip=_str(frames, 1, m, "decode ip"),
            decode_port=_int(frames, 2, m, "port"),
            session=_str(frames, 3, m, "session id"),
            dst_pages=pages,
            dst_aux_index=_int(frames, 5, m, "dst aux index"),
            required_dst_info_num=_int(frames, 7, m, "required_dst_info_num"),
            decode_prefix_len=_int(frames, 8, m, "decode_prefix_len"),
        )


@dataclass(frozen=True)
class Abort:
    """Decode -> prefill: decode gave up on ``room``; ack once nothing can write its pages."""

    room: int
    decode_ip: str
    decode_port: int

    def to_frames(self) -> list[bytes]:
        return [ABORT_TAG, _a(self.room), _a(self.decode_ip), _a(self.decode_port)]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Abort:
        m = "ABORT"
        _count(frames, 4, m)
        return cls(
            _int(frames, 1, m, "room"), _str(frames, 2, m, "decode ip"), _int(frames, 3, m, "port")
        )


@dataclass(frozen=True)
class Status:
    """Prefill -> decode: ``room`` reached ``status`` (a ``KVPoll`` value) on prefill rank
    ``rank``."""

    room: int
    status: int
    rank: int = 0

    def to_frames(self) -> list[bytes]:
        return [_a(self.room), _a(self.status), _a(self.rank)]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Status:
        m = "STATUS"
        _count(frames, 3, m)
        status = _int(frames, 1, m, "status")
        if not 0 <= status <= 4:
            raise ControlMessageError(f"{m}: status {status} is not a KVPoll value")
        return cls(_int(frames, 0, m, "room"), status, _int(frames, 2, m, "rank"))


@dataclass(frozen=True)
class AbortAck:
    """Prefill -> decode: no engine call can write ``room``'s pages any more."""

    room: int
    rank: int = 0

    def to_frames(self) -> list[bytes]:
        return [ABORT_ACK_TAG, _a(self.room), _a(self.rank)]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> AbortAck:
        m = "ABORT_ACK"
        _count(frames, 3, m)
        return cls(_int(frames, 1, m, "room"), _int(frames, 2, m, "rank"))


def parse_to_prefill(frames: list[bytes]) -> Register | Meta | Abort:
    """What the prefill side's listener receives, told apart by the first frame as SGLang's
    bootstrap thread does."""
    if not frames:
        raise ControlMessageError("an empty message")
    if frames[0] == ABORT_TAG:
        return Abort.from_frames(frames)
    if frames[0] == REGISTER_ROOM:
        return Register.from_frames(frames)
    return Meta.from_frames(frames)


def parse_to_decode(frames: list[bytes]) -> Status | AbortAck:
    """What the decode side's listener receives."""
    if not frames:
        raise ControlMessageError("an empty message")
    if frames[0] == ABORT_ACK_TAG:
        return AbortAck.from_frames(frames)
    return Status.from_frames(frames)
