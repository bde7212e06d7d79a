"""The suite's own set-up (``conftest.py``): under several xdist workers each uses one OpenMP thread, and no test
waits on the Hub."""

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


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") != "1", reason="the Hub allowed on purpose (HF_HUB_OFFLINE set)")
def test_the_hub_is_offline_in_process():
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: set after it, a test that names a model not on disk
    waited tens of seconds through HTTP back-off instead of failing."""
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE
