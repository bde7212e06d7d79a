"""The live run page over HTTP: the standard library's threading server, read-only, on 127.0.0.1 unless told.

Routes, and nothing else (every other path, whatever its encoding, answers 404):
  /                      the page (page.html; it asks the two routes below every ``refresh`` seconds)
  /static/NAME           the page's own script, style and chart library, by a fixed list of names
  /api/runs              the runs served: name, folder name, last step
  /api/run/NAME          one run's state (``state.run_state``), NAME as /api/runs lists it
No request path is ever joined to a folder: runs are found by scanning the folders given at start (and again
when asked for one not yet known), files are read without following links (``state.read_own``)."""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from leansft.core.errors import LeanSFTError
from leansft.recipe.run_page.page import STATIC, page_html
from leansft.recipe.run_page.state import find_runs, run_state

log = logging.getLogger("leansft")
# The page's scripts and styles come from this server alone; the run's texts are never markup (page.js sets
# textContent), and this policy would stop a script that got in anyway.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'")


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
            path = urlsplit(self.path).path
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
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: a page asks every 2 s
            log.debug("run page: " + format, *args)

    return Handler


def start(roots: list[Path], host: str = "127.0.0.1", port: int = 8765, refresh: float = 2.0) -> ThreadingHTTPServer:
    """A server for the run page, answering in a daemon thread (``server.shutdown()`` stops it); port 0: any free."""
    try:
        server = ThreadingHTTPServer((host, port), _handler(RunPage(roots, refresh)))
    except OSError as err:  # the port taken (a second run's page), or an address this machine does not have
        raise LeanSFTError(f"the run page cannot listen on {host}:{port}: {err.strerror}", field="--port",
                           hint="--port N for another port (0: any free one), or --host for another address") from err
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="leansft-run-page", daemon=True).start()
    return server


def url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/"
