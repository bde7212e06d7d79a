"""The page itself: page.html around one renderer (static/page.js), served live or written once with the runs'
state inside it (report.html, opened from disk: its script, styles and data inlined).

The chart library is uPlot (MIT, from the npm registry's ``uplot`` 1.6.32, vendored in static/ with its licence):
~50 KB, no dependencies and no build step, and it redraws thousands of points in a millisecond, so a page that
asks every 2 s stays light."""

from __future__ import annotations

import json
from importlib import resources

_FILES = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8",
          "uPlot.iife.min.js": "text/javascript; charset=utf-8", "uPlot.min.css": "text/css; charset=utf-8"}


def _read(name: str) -> bytes:
    return resources.files("leansft.recipe.run_page").joinpath("static", name).read_bytes()


STATIC: dict[str, tuple[bytes, str]] = {name: (_read(name), kind) for name, kind in _FILES.items()}

_BODY = """<header><h1 id="title">leansft</h1><span id="status"></span></header>
<nav id="runs"></nav>
<main id="page"><p class="muted">waiting for the run's first figures...</p></main>"""


def page_html(refresh: float) -> str:
    """The live page: it loads its script and styles from the server and asks /api every ``refresh`` seconds."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>leansft run</title>'
            f'<link rel="icon" href="data:,"><link rel="stylesheet" href="/static/uPlot.min.css"><link rel="stylesheet" href="/static/page.css">'
            f'</head>\n<body data-refresh="{float(refresh)}">{_BODY}\n'
            f'<script src="/static/uPlot.iife.min.js"></script><script src="/static/page.js"></script>'
            f'</body></html>\n')


def _inline_json(value) -> str:
    """JSON safe inside a <script> element: ``<``, ``>`` and ``&`` escaped, so a sample holding ``</script>`` stays
    text of the data."""
    text = json.dumps(value, allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def static_html(states: list[dict]) -> str:
    """report.html: the same page with the runs' state in it, readable from disk without a server."""
    css = (STATIC["uPlot.min.css"][0] + b"\n" + STATIC["page.css"][0]).decode()
    scripts = "".join(f"<script>{STATIC[n][0].decode()}</script>" for n in ("uPlot.iife.min.js", "page.js"))
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>leansft run report</title>'
            f'<link rel="icon" href="data:,"><style>{css}</style></head>\n<body data-refresh="0">{_BODY}\n'
            f'<script type="application/json" id="runs-data">{_inline_json(states)}</script>{scripts}'
            '</body></html>\n')
