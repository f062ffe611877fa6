"""The ZMQ sockets of the control plane, as SGLang's (PUSH -> PULL multipart over TCP), with the
limits a hostile or broken peer needs: ``Listener`` (one bound PULL socket, its thread hands
each message to a handler; ``ZMQ_MAXMSGSIZE`` per frame, at most ``MAX_FRAMES`` frames a message,
peers that never finish the ZMTP handshake dropped, at most ``max_connections`` TCP connections)
and ``Pusher`` (one PUSH socket per endpoint, non-blocking sends into a bounded per-endpoint queue,
so a slow or dead endpoint never delays another's messages; at most ``max_endpoints`` sockets).
Nothing is authenticated by default (as SGLang's plane): keep it on a trusted network. Opt-in,
``HICACHE_PD_SHARED_SECRET`` on every side turns on ZMQ CURVE (the server key pair derived from
the secret: a peer without it can neither connect nor read) and a bootstrap header; SGLang's
own decode servers cannot join such a plane."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import socket
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from hicache_prefill.prefill.disagg.mooncake.wire import MAX_FRAMES, ControlMessageError

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20
"""``ZMQ_MAXMSGSIZE`` of a PULL socket: twice META's largest page list (``MAX_META_PAGES``)."""
MAX_CONNECTIONS = 256
HANDSHAKE_S = 5.0
SEND_HWM = 1000


def check_bind_host(host: str, what: str) -> None:
    """Warn when ``host`` is not a loopback address: the control plane and the bootstrap
    endpoint are not authenticated (as SGLang's) and must stay on a trusted network."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        msg = (
            f"{what} binds {host}, not a loopback address: the PD control plane is not "
            "authenticated; keep it on a trusted network"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        logger.warning("%s", msg)


SECRET_ENV = "HICACHE_PD_SHARED_SECRET"


def secret_from_env() -> str | None:
    """The opt-in shared secret (``HICACHE_PD_SHARED_SECRET``), or ``None`` (SGLang's plane)."""
    return os.environ.get(SECRET_ENV) or None


def curve_server_keys(secret: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 CURVE keys of every control socket's server side, derived from
    the shared secret (any 32 bytes are a curve25519 secret key)."""
    seed = hashlib.sha256(b"hicache-pd-control:" + secret.encode()).digest()
    private = zmq.utils.z85.encode(seed)
    return zmq.curve_public(private), private


def _context() -> zmq.Context:
    return zmq.Context.instance()


class Listener:
    """A PULL socket bound to ``host`` on a random port; every message goes to ``handler(frames)``
    on the listener's thread. A handler's ``ControlMessageError``, a message of too many frames
    and a refused connection are counted (``malformed``, ``refused``) and logged; it serves on."""

    def __init__(
        self,
        host: str,
        handler: Callable[[list[bytes]], None],
        name: str,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_connections: int = MAX_CONNECTIONS,
        secret: str | None = None,
    ) -> None:
        check_bind_host(host, name)
        self.handler = handler
        self.name = name
        self.host = host
        self.max_connections = max_connections
        self.malformed = 0
        self.refused = 0
        self.messages = 0
        self.last_error: str | None = None
        self._conns: set[int] = set()
        sock = _context().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if secret is not None:
            sock.curve_server = True
            sock.curve_secretkey = curve_server_keys(secret)[1]
        self.port = sock.bind_to_random_port(f"tcp://{host}")
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        self._monitor = sock.get_monitor_socket(events)
        self._sock = sock
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                ready = dict(poller.poll(50))
                if self._monitor in ready:
                    self._on_events()
                if self._sock in ready:
                    self._on_messages()
        finally:
            try:
                self._sock.unbind(self._sock.last_endpoint)
            except zmq.ZMQError:
                pass
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)

    def _on_events(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._conns.add(fd)
                if len(self._conns) > self.max_connections:
                    self._refuse(fd)
            else:
                self._conns.discard(fd)

    def _refuse(self, fd: int) -> None:
        """Shut a connection past the limit down (libzmq then closes it)."""
        self.refused += 1
        self._conns.discard(fd)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if s.getsockname()[1] == self.port:  # still that connection, not a reused fd
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
        if self.refused == 1 or self.refused % 100 == 0:
            logger.error("%s: %d connections refused (at most %d open)", self.name,
                         self.refused, self.max_connections)  # fmt: skip

    def _on_messages(self) -> None:
        for _ in range(256):  # then look at the monitor again
            try:
                first = self._sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            frames = [first]
            too_many = False
            while self._sock.getsockopt(zmq.RCVMORE):
                part = self._sock.recv(copy=True)
                if len(frames) < MAX_FRAMES:
                    frames.append(part)
                else:
                    too_many = True  # drained, not kept
            self.messages += 1
            if too_many:
                self._malformed(
                    ControlMessageError(f"more than {MAX_FRAMES} frames in one message")
                )
                continue
            try:
                self.handler(frames)
            except ControlMessageError as e:
                self._malformed(e)
            except Exception:  # a handler bug must not end the control plane
                logger.exception("%s: handler failed", self.name)

    def _malformed(self, e: Exception) -> None:
        self.malformed += 1
        self.last_error = str(e)
        logger.error("%s: malformed control message: %s", self.name, e)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)


class Pusher:
    """One-way pushes to ``(ip, port)`` endpoints over cached PUSH sockets. ``push`` never
    blocks and never raises: it returns whether the message was queued (at most ``SEND_HWM``
    per endpoint; as with SGLang's ZMQ, queued does not prove a dead peer read it). The least
    recently used socket is closed past ``max_endpoints``."""

    def __init__(self, max_endpoints: int = 256, secret: str | None = None) -> None:
        self.max_endpoints = max_endpoints
        self._server_key = curve_server_keys(secret)[0] if secret is not None else None
        self.dropped = 0
        self._socks: OrderedDict[tuple[str, int], zmq.Socket] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def push(self, endpoint: tuple[str, int], frames: Sequence[bytes]) -> bool:
        with self._lock:
            if self._closed:
                return False
            try:
                sock = self._socket(endpoint)
                sock.send_multipart(list(frames), zmq.NOBLOCK, copy=True)
                return True
            except zmq.Again:
                self.dropped += 1
                logger.warning("push to %s:%s dropped: its queue is full", *endpoint)
            except (zmq.ZMQError, ValueError) as e:
                self.dropped += 1
                logger.warning("push to %s:%s failed: %s", endpoint[0], endpoint[1], e)
                self._drop(endpoint)
            return False

    def _socket(self, endpoint: tuple[str, int]) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is not None:
            self._socks.move_to_end(endpoint)
            return sock
        while len(self._socks) >= self.max_endpoints:
            self._drop(next(iter(self._socks)))
        host, port = endpoint
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port {port!r}")
        sock = _context().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if self._server_key is not None:
            sock.curve_serverkey = self._server_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        addr = f"[{host}]" if ":" in host else host
        sock.connect(f"tcp://{addr}:{port}")
        self._socks[endpoint] = sock
        return sock

    def _drop(self, endpoint: tuple[str, int]) -> None:
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def forget(self, endpoint: tuple[str, int]) -> None:
        with self._lock:
            self._drop(endpoint)

    @property
    def endpoints(self) -> int:
        return len(self._socks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for endpoint in list(self._socks):
                self._drop(endpoint)
