"""The suite's own set-up: under several xdist workers each uses one OpenMP thread (``conftest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2, reason="needs several xdist workers")
def test_each_worker_and_the_runs_it_starts_use_one_thread():
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert (torch.get_num_threads(), child) == (1, "1")
