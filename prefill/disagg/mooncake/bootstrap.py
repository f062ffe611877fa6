"""The bootstrap endpoint of a prefill instance, as SGLang 0.5.23's ``CommonKVBootstrapServer``:
``PUT /route`` (a prefill rank registers), ``GET /route`` (all ``-1``: ``PrefillServerInfo``,
its fields exactly; else that rank's ``{rank_ip, rank_port}``; 503 until every rank
registered), ``POST /register_dp_rank``, ``POST /query_dp_ranks``, ``GET /health``; and the
decode side's client of it. Hardened: at most ``max_threads`` requests in service (others are
closed at once), each one closed after ``request_timeout_s`` whatever it sent, bodies over
``MAX_BODY`` refused. Not authenticated (as SGLang's) unless given the opt-in shared secret:
then every request must carry it in ``SECRET_HEADER`` (403 otherwise)."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from hicache_prefill.prefill.disagg.mooncake.channel import check_bind_host

logger = logging.getLogger(__name__)

ROUTE_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
PUT_KEYS = (
    "attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size",
    "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip",
    "rank_port", "page_size", "kv_cache_dtype",
)  # fmt: skip
MAX_BODY = 1 << 20
SECRET_HEADER = "X-Hicache-PD-Secret"
ROOM_ENTRY_TTL_S = 120.0  # SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL


class RouteTable:
    """What ``PUT /route`` registered, and the ``PrefillServerInfo`` built from it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sizes: dict[str, Any] | None = None
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.room_dp: dict[int, tuple[int, float]] = {}

    def put(self, data: dict[str, Any]) -> str | None:
        """Register one rank; the reason it is refused, or ``None``."""
        missing = [k for k in PUT_KEYS if k not in data]
        if missing:
            return f"missing {', '.join(missing)}"
        try:
            ints = {k: int(data[k]) for k in PUT_KEYS if k not in ("rank_ip", "kv_cache_dtype")}
        except (TypeError, ValueError):
            return "sizes, ranks, rank_port and page_size must be integers"
        policy = data.get("decode_allocation_policy", "early")
        dp = ints["attn_dp_size"] if ints["system_dp_size"] == 1 else ints["system_dp_size"]
        group = ints["attn_dp_rank"] if ints["system_dp_size"] == 1 else ints["system_dp_rank"]
        with self.lock:
            if self.sizes is not None and self.sizes["decode_allocation_policy"] != policy:
                return "Inconsistent prefill allocation policies"
            if self.sizes is None:
                self.sizes = {
                    "attn_tp_size": ints["attn_tp_size"],
                    "attn_cp_size": ints["attn_cp_size"],
                    "dp_size": dp,
                    "pp_size": ints["pp_size"],
                    "page_size": ints["page_size"],
                    "kv_cache_dtype": data["kv_cache_dtype"],
                    "kv_layout": data.get("kv_layout"),
                    "follow_bootstrap_room": data.get("load_balance_method",
                                                      "follow_bootstrap_room")
                    == "follow_bootstrap_room",
                    "enable_dsa_cache_layer_split": bool(
                        data.get("enable_dsa_cache_layer_split", False)),
                    "enable_kv_cache_sharding": bool(data.get("enable_kv_cache_sharding", False)),
                    "prefill_http_port": data.get("prefill_http_port"),
                    "decode_allocation_policy": policy,
                }  # fmt: skip
            key = (group, ints["attn_cp_rank"], ints["attn_tp_rank"], ints["pp_rank"])
            self.ranks[key] = {"rank_ip": str(data["rank_ip"]), "rank_port": ints["rank_port"]}
        return None

    def ready(self) -> bool:
        with self.lock:
            s = self.sizes
            if s is None:
                return False
            want = s["dp_size"] * s["attn_cp_size"] * s["attn_tp_size"] * s["pp_size"]
            return len(self.ranks) >= want

    def server_info(self) -> dict[str, Any]:
        """``dataclasses.asdict(PrefillServerInfo(...))`` as SGLang's server answers it: every
        field, ``kv_layout`` and ``dsv41_spec_layout`` left out when ``None``."""
        with self.lock:
            s = dict(self.sizes or {})
        port = s["prefill_http_port"]
        info: dict[str, Any] = {
            "attn_tp_size": s["attn_tp_size"],
            "attn_cp_size": s["attn_cp_size"],
            "dp_size": s["dp_size"],
            "pp_size": s["pp_size"],
            "page_size": s["page_size"],
            "kv_cache_dtype": s["kv_cache_dtype"],
            "follow_bootstrap_room": s["follow_bootstrap_room"],
            "enable_dsa_cache_layer_split": s["enable_dsa_cache_layer_split"],
            "kv_layout": s["kv_layout"],
            "decode_allocation_policy": s["decode_allocation_policy"],
            "enable_kv_cache_sharding": s["enable_kv_cache_sharding"],
            "prefill_http_port": int(port) if port is not None else None,
            "target_tp_rank": None,
            "target_tp_ranks": None,
            "target_cp_ranks": None,
            "target_pp_ranks": None,
            "required_dst_info_num": None,
            "required_prefill_response_num": None,
        }
        if info["kv_layout"] is None:
            del info["kv_layout"]
        return info

    def rank(self, key: tuple[int, int, int, int]) -> dict[str, Any] | None:
        with self.lock:
            return self.ranks.get(key)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], handler: Any, max_threads: int,
                 timeout_s: float) -> None:  # fmt: skip
        self.slots = threading.BoundedSemaphore(max_threads)
        self.timeout_s = timeout_s
        self.shed = 0
        self.expired = 0
        self.live: dict[socket.socket, float] = {}
        self.live_lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shed += 1  # every service thread busy: close at once, never queue a thread
            self.shutdown_request(request)
            return
        with self.live_lock:
            self.live[request] = time.monotonic() + self.timeout_s
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self.live_lock:
            if self.live.pop(request, None) is not None:
                self.slots.release()

    def reap(self) -> None:
        """Shut down connections past their deadline (slow or half-sent requests)."""
        now = time.monotonic()
        with self.live_lock:
            late = [s for s, t in self.live.items() if t <= now]
        for s in late:
            self.expired += 1
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class BootstrapServer:
    """SGLang's bootstrap routes on ``host:port`` (module docstring). ``ValueError`` naming
    ``--disaggregation-bootstrap-port`` when it cannot be bound."""

    def __init__(
        self,
        host: str,
        port: int,
        max_threads: int = 16,
        request_timeout_s: float = 5.0,
        secret: str | None = None,
    ) -> None:
        check_bind_host(host, "the bootstrap endpoint")
        self.routes = RouteTable()
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # per socket operation; the reaper bounds the whole

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes | str, ctype: str = "text/plain") -> None:
                data = body.encode() if isinstance(body, str) else body
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _denied(self) -> bool:
                if secret is None:
                    return False
                got = self.headers.get(SECRET_HEADER, "")
                if hmac.compare_digest(got.encode(), secret.encode()):
                    return False
                self._send(403, "Forbidden")
                return True

            def _json(self, obj: Any) -> None:
                self._send(200, json.dumps(obj).encode(), "application/json")

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                if not 0 <= n <= MAX_BODY:
                    raise ValueError(f"a body of {n} bytes (at most {MAX_BODY})")
                return json.loads(self.rfile.read(n) or b"null")

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self._denied():
                    return
                url = urlparse(self.path)
                if url.path == "/health":
                    return self._send(200, "OK")
                if url.path != "/route":
                    return self._send(404, "Not Found")
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    key = tuple(int(query[k]) for k in ROUTE_KEYS)
                except (KeyError, ValueError):
                    return self._send(400, "Missing inputs for bootstrap server.")
                if not routes.ready():
                    n = len(routes.ranks)
                    return self._send(
                        503, f"Prefill server not fully registered yet ({n} workers registered)."
                    )
                if all(r == -1 for r in key):
                    return self._json(routes.server_info())
                rank = routes.rank(key)  # type: ignore[arg-type]
                if rank is None:
                    return self._send(
                        404,
                        f"Bootstrap info not found for {dict(zip(ROUTE_KEYS, key, strict=True))}",
                    )
                return self._json(rank)

            def do_PUT(self) -> None:  # noqa: N802
                if self._denied():
                    return
                if urlparse(self.path).path != "/route":
                    return self._send(405, "Method not allowed")
                try:
                    data = self._body()
                    why = routes.put(data) if isinstance(data, dict) else "not a JSON object"
                except ValueError as e:
                    why = str(e)
                if why is not None:
                    return self._send(400, why)
                return self._send(200, "OK")

            def do_POST(self) -> None:  # noqa: N802
                if self._denied():
                    return
                path = urlparse(self.path).path
                try:
                    data = self._body()
                    if path == "/register_dp_rank":
                        room, dp = int(data["bootstrap_room"]), int(data["dp_rank"])
                        with routes.lock:
                            now = time.time()
                            for r in [r for r, (_, t) in routes.room_dp.items()
                                      if now - t > ROOM_ENTRY_TTL_S]:  # fmt: skip
                                del routes.room_dp[r]
                            if len(routes.room_dp) >= 1 << 16:
                                return self._send(503, "too many rooms registered")
                            routes.room_dp[room] = (dp, now)
                        return self._send(200, "OK")
                    if path == "/query_dp_ranks":
                        with routes.lock:
                            found = {str(int(r)): routes.room_dp[int(r)][0]
                                     for r in data["bootstrap_rooms"][:4096]
                                     if int(r) in routes.room_dp}  # fmt: skip
                        return self._json(found)
                except (ValueError, KeyError, TypeError) as e:
                    return self._send(400, f"bad request: {e}")
                return self._send(404, "Not Found")

        try:
            self._http = _Server((host, port), Handler, max_threads, request_timeout_s)
        except OSError as e:
            raise ValueError(
                f"--disaggregation-bootstrap-port {port}: cannot listen on {host}:{port} ({e})"
            ) from e
        self.host = host
        self.port = self._http.server_address[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(0.1,), name="bootstrap-http", daemon=True
        )
        self._thread.start()
        self._reaper = threading.Thread(target=self._reap, name="bootstrap-reap", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        while not self._closed.wait(0.25):
            self._http.reap()

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def stats(self) -> dict[str, int]:
        return {"shed": self._http.shed, "expired": self._http.expired,
                "in_service": len(self._http.live)}  # fmt: skip

    def close(self) -> None:
        self._closed.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
        self._reaper.join(timeout=5)


class BootstrapUnreachable(RuntimeError):
    """The bootstrap endpoint did not answer (the message names the address and why)."""


def http(addr: str, path: str, timeout_s: float = 5.0, method: str = "GET",
         body: Any = None, secret: str | None = None) -> bytes:  # fmt: skip
    """One request to ``http://addr/path`` (with the shared secret's header when given);
    ``BootstrapUnreachable`` naming the URL on any failure or non-200 answer."""
    url = f"http://{addr}{path}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if secret is not None:
        req.add_header(SECRET_HEADER, secret)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        raise BootstrapUnreachable(f"{method} {url}: HTTP {e.code} {e.read()[:120]!r}") from None
    except (OSError, ValueError) as e:
        raise BootstrapUnreachable(f"{method} {url}: {e}") from None


def fetch_route(
    addr: str, timeout_s: float = 5.0, secret: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(PrefillServerInfo fields, rank 0's {rank_ip, rank_port})`` of the prefill instance at
    ``addr`` (``host:port``), as SGLang's decode asks for them."""
    allm1 = "&".join(f"{k}=-1" for k in ROUTE_KEYS)
    rank0 = "&".join(f"{k}=0" for k in ROUTE_KEYS)
    try:
        info = json.loads(http(addr, f"/route?{allm1}", timeout_s, secret=secret))
        rank = json.loads(http(addr, f"/route?{rank0}", timeout_s, secret=secret))
    except ValueError as e:
        raise BootstrapUnreachable(f"bootstrap {addr} answered no JSON ({e})") from None
    if not isinstance(rank, dict) or "rank_ip" not in rank or "rank_port" not in rank:
        raise BootstrapUnreachable(f"bootstrap {addr}: rank info {rank} has no rank_ip/rank_port")
    return info, rank


def healthy(addr: str, timeout_s: float = 2.0, secret: str | None = None) -> bool:
    try:
        return http(addr, "/health", timeout_s, secret=secret) == b"OK"
    except BootstrapUnreachable:
        return False
