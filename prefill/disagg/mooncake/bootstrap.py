"""The bootstrap endpoint of a prefill instance (SGLang's ``CommonKVBootstrapServer``: ``GET
/route`` for the server info or a rank's control endpoint, ``GET /health``), and the decode
side's client of it."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

ROUTE_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class BootstrapServer:
    """Serves ``server_info`` and rank 0's ``rank_info`` on ``host:port`` (``ValueError`` naming
    ``--disaggregation-bootstrap-port`` when it cannot be bound)."""

    def __init__(
        self, host: str, port: int, server_info: dict[str, Any], rank_info: dict[str, Any]
    ) -> None:
        info = json.dumps(server_info).encode()
        rank = json.dumps(rank_info).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                if url.path == "/health":
                    return self._send(200, b"OK", "text/plain")
                if url.path != "/route":
                    return self._send(404, b"Not Found", "text/plain")
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    ranks = [int(query[k]) for k in ROUTE_KEYS]
                except (KeyError, ValueError):
                    return self._send(400, b"Missing inputs for bootstrap server.", "text/plain")
                if all(r == -1 for r in ranks):
                    return self._send(200, info)
                if all(r == 0 for r in ranks):
                    return self._send(200, rank)
                return self._send(404, b"Bootstrap info not found", "text/plain")

        try:
            self._http = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ValueError(
                f"--disaggregation-bootstrap-port {port}: cannot listen on {host}:{port} ({e})"
            ) from e
        self._http.daemon_threads = True
        self.host = host
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="bootstrap-http", daemon=True
        )
        self._thread.start()

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


class BootstrapUnreachable(RuntimeError):
    """The bootstrap endpoint did not answer (the message names the address and why)."""


def _get(addr: str, path: str, timeout_s: float) -> bytes:
    url = f"http://{addr}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        raise BootstrapUnreachable(f"GET {url}: HTTP {e.code} {e.read()[:80]!r}") from None
    except (OSError, ValueError) as e:
        raise BootstrapUnreachable(f"GET {url}: {e}") from None


def fetch_route(addr: str, timeout_s: float = 2.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(server_info, rank_info)`` of the prefill instance at ``addr`` (``host:port``)."""
    allm1 = "&".join(f"{k}=-1" for k in ROUTE_KEYS)
    rank0 = "&".join(f"{k}=0" for k in ROUTE_KEYS)
    try:
        info = json.loads(_get(addr, f"/route?{allm1}", timeout_s))
        rank = json.loads(_get(addr, f"/route?{rank0}", timeout_s))
    except ValueError as e:
        raise BootstrapUnreachable(f"bootstrap {addr} answered no JSON ({e})") from None
    if "rank_ip" not in rank or "rank_port" not in rank:
        raise BootstrapUnreachable(f"bootstrap {addr}: rank info {rank} has no rank_ip/rank_port")
    return info, rank


def healthy(addr: str, timeout_s: float = 2.0) -> bool:
    try:
        return _get(addr, "/health", timeout_s) == b"OK"
    except BootstrapUnreachable:
        return False
