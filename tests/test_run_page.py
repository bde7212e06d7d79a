"""The run page (``leansft report --serve``, ``train --serve``, report.html): its routes and nothing else, no file
outside the run folders it was given, the run's texts shown as text, and a live run watched in headless Chromium."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from urllib.request import urlopen

import launcher
import pytest
import yaml
from helpers import run_config

from leansft.core.errors import LeanSFTError
from leansft.tools import run_page

SCRIPT = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def crafted_run(folder: Path) -> Path:
    """A run folder written by hand: two logged steps, a sample holding markup, a data report that is a link to a
    file outside it."""
    folder.mkdir(parents=True)
    steps = [{"step": s, "loss": 2.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "real_tokens_per_s": 100.0,
              "target_tokens_per_s": 50.0, "padding_share": 0.0, "peak_memory_bytes": 1e9, "mfu": None,
              "tokens_seen": 100 * s} for s in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps) + '{"step": 3, "lo')  # torn
    (folder / "samples.jsonl").write_text(json.dumps({"step": 0, "prompt": "Say hi", "answer": SCRIPT}) + "\n")
    (folder / "config.yaml").write_text("model: tiny\n")
    (folder / "data_report.json").symlink_to("/etc/passwd")
    suite = [{"suite": SCRIPT, "kind": "qa", "metric": "exact_match", "n": 2, "step": step, "score": score,
              "items": [{"score": a}, {"score": b}]} for step, score, a, b in ((0, 0.5, 1.0, 0.0), (2, 1.0, 1.0, 1.0))]
    (folder / "suites.jsonl").write_text("".join(json.dumps(r) + "\n" for r in suite))
    return folder


def get(server, path: str, method: str = "GET", headers: dict | None = None, reply_headers: bool = False):
    """``(status, body)`` of ``path`` sent exactly as written (no client-side normalising of ``..`` or escapes);
    ``headers`` (a ``Host`` among them) as given."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection("127.0.0.1" if host == "0.0.0.0" else host, port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        reply = conn.getresponse()
        return (reply.status, reply.read()) + ((reply.headers,) if reply_headers else ())
    finally:
        conn.close()


@pytest.fixture
def served(tmp_path):
    """A folder of runs (one real, one a link to another folder of the machine) served on a free port."""
    crafted_run(tmp_path / "runs" / "mine")
    (tmp_path / "runs" / "elsewhere").symlink_to("/etc")
    server = run_page.start([tmp_path / "runs"], port=0)
    yield server
    server.shutdown()


def test_the_page_serves_its_runs_and_nothing_else(served):
    assert served.server_address[0] == "127.0.0.1"  # loopback unless --host
    status, body = get(served, "/api/runs")
    assert status == 200 and [r["name"] for r in json.loads(body)] == ["mine"]  # the link out is no run
    status, body = get(served, "/api/run/mine")
    state = json.loads(body)
    assert status == 200 and [r["step"] for r in state["metrics"]] == [1, 2]  # the torn line left out
    assert state["samples"][0]["answer"] == SCRIPT  # data, as the run wrote it
    assert state["data_report"] is None  # a link out of the run reads as absent
    (row,) = state["suites"]  # the suites before and after, without their items
    assert (row["suite"], row["before"], row["after"], row["delta"]) == (SCRIPT, 0.5, 1.0, 0.5)
    status, body = get(served, "/")
    assert status == 200 and b"/static/page.js" in body
    for path in ("/../etc/passwd", "/static/../../etc/passwd", "/static/%2e%2e/page.py", "/static/..%2fpage.py",
                 "/static/page.py", "/api/run/..%2F..%2Fetc", "/api/run/%2e%2e", "/api/run/elsewhere",
                 "/api/run/mine%2Fmetrics.jsonl", "/api/run/mine/metrics.jsonl", "//etc/passwd", "/etc/passwd",
                 "/mine/metrics.jsonl", "/api/run/..\\..\\etc", "/api/run/%2Fetc%2Fpasswd"):
        status, body = get(served, path)
        assert status == 404 and b"root:" not in body, path
    assert get(served, "/api/runs", "POST")[0] == 501  # read-only: GET and HEAD alone
    # a second page on the same port: one line saying what to do
    with pytest.raises(LeanSFTError, match="(?s)cannot listen on 127.0.0.1:.*in use.*--port N"):
        run_page.start([], port=served.server_address[1])


ROUTES = ("/", "/index.html", "/static/page.js", "/api/runs", "/api/run/mine")


def test_a_request_for_another_host_gets_no_run_data(tmp_path):
    """DNS rebinding: a web page whose name now points at 127.0.0.1 sends its own name as ``Host``. Only the page's
    names answer: loopback ones with its port, ``--allow-host`` names on any port."""
    crafted_run(tmp_path / "runs" / "mine")
    server = run_page.start([tmp_path / "runs"], port=0, allow_hosts=["runs.lab.example"])
    port = server.server_address[1]
    try:
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", f"127.0.0.1:{port + 1}",
                     f"localhost:{port}@evil.example", "", f"10.1.2.3:{port}"):
            for path in ROUTES:
                status, body = get(server, path, headers={"Host": host})
                assert status == 403 and b"mine" not in body and b"Say hi" not in body, (host, path)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "127.0.0.1",
                     "runs.lab.example", "runs.lab.example:443"):
            status, body = get(server, "/api/run/mine", headers={"Host": host})
            assert status == 200 and b"Say hi" in body, host
        assert run_page.url(server) == f"http://127.0.0.1:{port}/" and run_page.exposure(server) is None
    finally:
        server.shutdown()


def test_a_page_past_loopback_asks_for_its_token(tmp_path):
    """``--host 0.0.0.0``: every route answers 403 without the token printed in the URL; the first page sets it as
    a cookie that the page's own requests carry; the command warns that the page is open to whoever has the URL."""
    crafted_run(tmp_path / "runs" / "mine")
    server = run_page.start([tmp_path / "runs"], host="0.0.0.0", port=0)
    port, token = server.server_address[1], server.access.token
    try:
        link = run_page.url(server)
        assert link.endswith(f":{port}/?token={token}") and "0.0.0.0" not in link and len(token) >= 32
        assert "0.0.0.0" in run_page.exposure(server) and "token" in run_page.exposure(server)
        here = {"Host": f"127.0.0.1:{port}"}
        for path in ROUTES:
            for extra in ({}, {"Cookie": "leansft_token=wrong"}):
                status, body = get(server, path, headers={**here, **extra})
                assert status == 403 and b"Say hi" not in body, path
            assert get(server, path + "?token=" + token[:-1] + "x", headers=here)[0] == 403
        status, body, headers = get(server, f"/?token={token}", headers=here, reply_headers=True)
        assert status == 200 and f"leansft_token={token}" in headers["Set-Cookie"]
        assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
        status, body = get(server, "/api/run/mine", headers={**here, "Cookie": f"other=1; leansft_token={token}"})
        assert status == 200 and b"Say hi" in body
        assert get(server, "/api/runs", headers={"Host": f"evil.example:{port}", "Cookie": f"leansft_token={token}"}
                   )[0] == 403  # the token does not open the page to another name
    finally:
        server.shutdown()


def until(read, done, timeout: float = 60) -> object:
    """``read()`` again until ``done`` holds for it (the page's policy forbids a script the test would inject)."""
    deadline = time.monotonic() + timeout
    while not done(value := read()):
        assert time.monotonic() < deadline, value
        time.sleep(0.1)
    return value


def _chromium() -> str:
    found = os.environ.get("LEANSFT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("no Chromium (Debian's chromium package; `make test` installs it where apt-get can)")
    pytest.importorskip("playwright.sync_api")
    return found


@pytest.mark.slow
def test_a_live_run_watched_in_chromium(tmp_path, tiny_run_assets):
    """``train --serve``: a name that resolves to 127.0.0.1 but is not the page's reads nothing; the loss chart
    gains points between two looks, a sample appears, no console errors; then a crafted run's markup sample shows as
    text, live and in report.html."""
    from playwright.sync_api import sync_playwright

    from leansft.recipe.report import write_report

    chromium = _chromium()
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=5000", "data.eval_split=0.1",
                     "eval.eval_every=40", "eval.samples_every=20", "eval.max_new_tokens=8",
                     "checkpoint.save_every=1000")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    with launcher.Launch(["-m", "leansft", "train", str(config), "--serve", "--port", "0"], env=env,
                         stderr_to_stdout=True) as proc:  # leaving it kills the run if it still runs
        errors: list[str] = []
        crafted = crafted_run(tmp_path / "crafted")
        page_server = run_page.start([crafted], port=0)
        watchdog = threading.Timer(240, proc.kill)  # a run that stalls silently ends; the test fails on what it said
        watchdog.start()
        try:
            url, said = None, []
            for line in proc.lines(timeout=120):
                said.append(line)
                found = re.search(r"the run page: (http://\S+)", line)
                url = found and found.group(1)
                if url:
                    break
            assert url, "".join(said)[-3000:]
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=[
                    "--no-sandbox", "--host-resolver-rules=MAP evil.example 127.0.0.1"])  # a rebound name
                page = browser.new_page()
                rebound = url.replace("127.0.0.1", "evil.example")
                for path in ("", "api/runs", "api/run/run"):  # the same server, by a foreign name: nothing to read
                    answer = page.goto(rebound + path)
                    assert answer.status == 403 and "forbidden" in page.content() and "loss" not in page.content()
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url + "?refresh=0.3")
                points = lambda: int(page.get_attribute("#chart-loss", "data-points") or 0)  # noqa: E731
                page.wait_for_selector("#chart-loss[data-points]", timeout=90_000)
                first = until(points, lambda n: n > 0)
                assert page.evaluate("tickLabels(null, [0, 0.0005, 0.001], 1, 0, 0.0005)") == [
                    "0.0000", "0.0005", "0.0010"]  # an lr axis's labels read apart (uPlot's own: 0, 0.001, 0.001)
                until(points, lambda n: n > first)  # a later look: more points
                page.wait_for_selector("#samples td", timeout=60_000)
                assert "step" in page.text_content("#status")
                state = json.loads(urlopen(url + "api/run/run", timeout=10).read())
                assert state["progress"]["total_steps"] == 5000 and state["progress"]["world_size"] == 1
                lengths = state["data_report"]["length_histogram"]  # the training examples' lengths, drawn as bars
                assert lengths["edges"][-1] == 192 and sum(lengths["counts"]) > 0
                assert page.get_attribute("#chart-lengths", "data-points") == str(len(lengths["counts"]))
                proc.kill()  # seen enough: the run need not finish
                for where in (run_page.url(page_server), None):  # the crafted run, live then from report.html
                    if where is None:
                        write_report(crafted, quiet=True)
                        where = (crafted / "report.html").as_uri()
                    page.goto(where)
                    page.wait_for_selector("#samples td")
                    assert SCRIPT in page.text_content("#samples")  # its markup is text
                    assert SCRIPT in page.text_content("#suites") and "+0.500" in page.text_content("#suites")
                    assert page.evaluate("window.__pwned") is None
                browser.close()
        finally:
            watchdog.cancel()
            page_server.shutdown()
    assert not errors, errors


def test_the_commands_take_allow_host(tmp_path, monkeypatch):
    """`report --serve` and `train --serve` hand every --allow-host NAME to the page."""
    from leansft.tools import cli

    args = cli.build_parser().parse_args(["train", "c.yaml", "--serve", "--allow-host", "a.example",
                                          "--allow-host", "b.example"])
    assert args.allow_host == ["a.example", "b.example"]
    crafted_run(tmp_path / "mine")
    started = {}

    class Started(Exception):
        pass

    def start(roots, host, port, refresh=2.0, allow_hosts=()):
        started["allow"] = list(allow_hosts)
        raise Started  # no server: the hand-over alone is checked

    monkeypatch.setattr(run_page, "start", start)
    with pytest.raises(Started):
        cli.main(["report", str(tmp_path / "mine"), "--serve", "--allow-host", "runs.lab.example"])
    assert started["allow"] == ["runs.lab.example"]
