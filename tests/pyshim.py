"""``python tests/pyshim.py ARGS...``: what ``python ARGS...`` does, in a process forked from the tests' fork server
(tests/launcher.py, where torch, transformers and leansft are imported already) when ``LEANSFT_TEST_PYSHIM`` names
the socket ``launcher.python_shim()`` serves; a plain ``python ARGS...`` otherwise.

For scripts that start Python many times, as ``PYTHON``: benchmarks/gpu_check.sh's miniature starts six. This process
imports only the standard library's socket and json, hands its standard streams, command line, folder and
environment over, and exits with the forked process's code; ended itself (``timeout``), its forked process ends too.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def main() -> int:
    path = os.environ.get("LEANSFT_TEST_PYSHIM")
    if not path:
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    request = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [len(request).to_bytes(8, "big")], [0, 1, 2])
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(64):
            reply += chunk
    code = int(reply or b"1")
    return 128 - code if code < 0 else code  # a signal's end as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
