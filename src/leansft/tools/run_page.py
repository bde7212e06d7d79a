"""The live run page over HTTP: the standard library's threading server, read-only, on 127.0.0.1 unless told.

Routes, and nothing else (every other path, whatever its encoding, answers 404):
  /                      the page (page.html; it asks the two routes below every ``refresh`` seconds)
  /static/NAME           the page's own script, style and chart library, by a fixed list of names
  /api/runs              the runs served: name, folder name, last step
  /api/run/NAME          one run's state (``state.run_state``), NAME as /api/runs lists it
No request path is ever joined to a folder: runs are found by scanning the folders given at start (and again
when asked for one not yet known), files are read without following links (``state.read_own``).

Who may ask (``Access``): a request whose ``Host`` header is not the page's own name gets 403 and no run data on
every route, so a web page that rebinds its own name to 127.0.0.1 (DNS rebinding) reads nothing; the names are the
loopback ones (127.0.0.1, localhost, [::1]) with the page's port, the ``--host`` given and ``--allow-host`` names.
On an address other than loopback the page also asks for a token, made anew at each start and printed in the one
URL that works (``?token=``); the first page sets it as a cookie, which the page's own requests then carry."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from leansft.core.errors import LeanSFTError
from leansft.recipe.run_page.page import STATIC, page_html
from leansft.recipe.run_page.state import find_runs, run_state

log = logging.getLogger("leansft")
# The page's scripts and styles come from this server alone; the run's texts are never markup (page.js sets
# textContent), and this policy would stop a script that got in anyway.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'")


COOKIE = "leansft_token"


def _address(name: str):
    """``name`` as an IP address ([::1] too), or None for a host name."""
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def _loopback(host: str) -> bool:
    address = _address(host)
    return host.lower() == "localhost" or (address is not None and address.is_loopback)


def _split_host(header: str) -> tuple[str, int | None] | None:
    """``Host: name[:port]`` as (lower-case name, port or None); None where it does not parse."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8765
        name, _, rest = header[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            return None
    else:
        name, colon, port = header.partition(":")
        port = port if colon else None
    if not name or (port is not None and not port.isdigit()):
        return None
    return name, int(port) if port is not None else None


@dataclass
class Access:
    """Which ``Host`` names the page answers and the token it asks for (None on loopback)."""

    port: int
    names: set[str] = field(default_factory=set)  # answered with the page's port (or none)
    allowed: set[str] = field(default_factory=set)  # ``--allow-host``: answered on any port (a proxy in front)
    any_ip: bool = False  # on every interface: an address typed as digits cannot be rebound, so any is answered
    token: str | None = None
    warned: set[str] = field(default_factory=set)  # the Host values refused so far (each said once)

    @classmethod
    def of(cls, host: str, port: int, allow: list[str] = ()) -> Access:
        names = {"127.0.0.1", "localhost", "::1", host.strip("[]").lower()}
        wildcard = host in ("0.0.0.0", "::", "")
        if wildcard:  # the names this machine answers to
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        token = None if _loopback(host) else secrets.token_urlsafe(24)
        return cls(port, names - {"0.0.0.0", "::", ""}, {a.strip("[]").lower() for a in allow}, wildcard, token)

    def host_refused(self, header: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused, or None."""
        parsed = _split_host(header or "")
        if parsed is None:
            return "no Host header" if not header else f"Host {header!r} does not parse"
        name, port = parsed
        if name in self.allowed:
            return None
        if port not in (None, self.port):
            return f"Host {header!r} names port {port}, not this page's {self.port}"
        if name in self.names or (self.any_ip and _address(name) is not None):
            return None
        return f"Host {header!r} is not this page's address (--allow-host NAME adds a name)"

    def token_given(self, query: str, cookie: str | None) -> str | None:
        """The token from the query (``?token=``) or the cookie, where it is the page's; None otherwise."""
        for given in [*parse_qs(query).get("token", []), *_cookie(cookie)]:
            if self.token is not None and hmac.compare_digest(given.encode(), self.token.encode()):
                return given
        return None


def _cookie(header: str | None) -> list[str]:
    out = []
    for part in (header or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == COOKIE:
            out.append(value)
    return out


class RunPage:
    """The runs under ``roots`` (run folders, or folders of runs), as the handler reads them."""

    def __init__(self, roots: list[Path], refresh: float = 2.0) -> None:
        self.roots, self.refresh = [Path(r) for r in roots], refresh
        self._lock = threading.Lock()
        self.runs = find_runs(self.roots)

    def run(self, name: str) -> Path | None:
        with self._lock:
            if name not in self.runs:  # a run started after the page: found by scanning again
                self.runs = find_runs(self.roots)
            return self.runs.get(name)

    def listing(self) -> list[dict]:
        with self._lock:
            self.runs = find_runs(self.roots)
            return [{"name": n, "folder": str(p)} for n, p in self.runs.items()]


def _handler(page: RunPage) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "leansft-run-page"
        sys_version = ""

        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self._answer(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(head=True)

        def _answer(self, head: bool) -> None:
            access = self.server.access
            refused = access.host_refused(self.headers.get("Host"))
            if refused is not None:  # before any route: a rebound name reads nothing
                if refused not in access.warned:  # a page asking every 2 s is said once
                    access.warned.add(refused)
                    log.warning("run page: refused a request: %s", refused)
                return self._send(403, f"forbidden: {refused}\n".encode(), "text/plain; charset=utf-8", head)
            parts = urlsplit(self.path)
            path, self._set_token = parts.path, None
            if access.token is not None:
                given = access.token_given(parts.query, self.headers.get("Cookie"))
                if given is None:
                    return self._send(403, b"forbidden: this page asks for its token: open the URL the command "
                                           b"printed (?token=...)\n", "text/plain; charset=utf-8", head)
                self._set_token = given if given not in _cookie(self.headers.get("Cookie")) else None
            if path in ("/", "/index.html"):
                return self._send(200, page_html(page.refresh).encode(), "text/html; charset=utf-8", head)
            if path.startswith("/static/") and path[len("/static/"):] in STATIC:
                body, kind = STATIC[path[len("/static/"):]]
                return self._send(200, body, kind, head)
            if path == "/api/runs":
                return self._json(page.listing(), head)
            if path.startswith("/api/run/"):
                name = unquote(path[len("/api/run/"):])
                run = page.run(name) if "/" not in name and "\\" not in name else None
                if run is not None:
                    return self._json(run_state(name, run), head)
            self._send(404, b"not found\n", "text/plain; charset=utf-8", head)

        def _json(self, value, head: bool) -> None:
            self._send(200, json.dumps(value, allow_nan=False, default=str).encode(), "application/json", head)

        def _send(self, status: int, body: bytes, kind: str, head: bool) -> None:
            self.send_response(HTTPStatus(status))
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CSP)
            if getattr(self, "_set_token", None) and status == 200:  # the page's own requests carry it from here on
                self.send_header("Set-Cookie", f"{COOKIE}={self._set_token}; Path=/; HttpOnly; SameSite=Strict")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: a page asks every 2 s
            log.debug("run page: " + format, *args)

    return Handler


class _Server(ThreadingHTTPServer):
    access: Access


class _Server6(_Server):
    address_family = socket.AF_INET6


def start(roots: list[Path], host: str = "127.0.0.1", port: int = 8765, refresh: float = 2.0,
          allow_hosts: list[str] = ()) -> _Server:
    """A server for the run page, answering in a daemon thread (``server.shutdown()`` stops it); port 0: any free.
    ``server.access`` holds the names it answers and its token (None on loopback)."""
    kind = _Server6 if ":" in host.strip("[]") else _Server
    try:
        server = kind((host.strip("[]"), port), _handler(RunPage(roots, refresh)))
    except OSError as err:  # the port taken (a second run's page), or an address this machine does not have
        raise LeanSFTError(f"the run page cannot listen on {host}:{port}: {err.strerror}", field="--port",
                           hint="--port N for another port (0: any free one), or --host for another address") from err
    server.access = Access.of(host.strip("[]"), server.server_address[1], list(allow_hosts))  # the port, once bound
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="leansft-run-page", daemon=True).start()
    return server


def url(server: _Server) -> str:
    """The one URL that opens the page: the address bound (this machine's name where it listens on every
    interface), and the token where it asks for one."""
    host, port = server.server_address[:2]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    host = f"[{host}]" if ":" in host else host
    token = server.access.token
    return f"http://{host}:{port}/" + (f"?token={token}" if token else "")


def exposure(server: _Server) -> str | None:
    """Where the page listens past loopback, the warning its command prints; else None."""
    if server.access.token is None:
        return None
    host, port = server.server_address[:2]
    return (f"the run page listens on {host}:{port}, not loopback: anyone who can reach it and has its URL (the "
            "token in it) reads the run")
