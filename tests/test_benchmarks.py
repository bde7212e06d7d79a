"""The GPU check runs in miniature on the CPU: a GPU is lent rarely and for minutes, and a change elsewhere must not
leave it to find benchmarks/gpu_check.sh broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import launcher
import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("gemm", "head", "bench", "profile", "trl")  # bench8b: its shapes go into bench in miniature


@pytest.mark.slow
def test_the_gpu_check_runs_in_miniature_on_the_cpu(tmp_path):
    """Every part of benchmarks/gpu_check.sh runs (GPU_CHECK_MINI=1: tiny shapes, a step or two) and appends its
    measurements to results.jsonl with the fields the issue's readers use; the script ends 0."""
    results = tmp_path / "results.jsonl"
    with launcher.python_shim() as python:  # its six Python processes forked, not started (tests/pyshim.py)
        env = {**os.environ, "GPU_CHECK_MINI": "1", **python, "LEANSFT_RESULTS": str(results),
               "LEANSFT_BENCH_WORK": str(tmp_path / "work"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                              env=env, timeout=600, check=False)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert all(f"{p}=rc0" in proc.stdout for p in PARTS), tail
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert {r["part"] for r in rows} == {"gemm", "head", "bench", "profile", "trl"}, rows
    assert all(r["device"] == "CPU" and r["torch"] and "error" not in r for r in rows), rows
    bench = [r for r in rows if r["part"] == "bench"]
    assert {(r["shape"], r["bare_loop"]) for r in bench} == {(s, b) for s in ("tiny", "tiny-lora") for b in (0, 1)}
    for r in bench:
        assert {"method", "compiled", "real_tokens_per_s", "mfu", "peak_gb", "recompiles"} <= set(r), r
        assert r["real_tokens_per_s"] > 0 and r["recompiles"] == 0
    assert {r["variant"] for r in rows if r["part"] == "head"} >= {"chunked_fp32", "chunked_bf16", "full_logits"}
    profile = next(r for r in rows if r["part"] == "profile")
    assert 0 <= profile["idle_share"] <= 1 and profile["fp32_gemm_share"] > 0
    trl = {r["side"]: r for r in rows if r["part"] == "trl"}
    assert set(trl) == {"leansft", "trl_best", "trl_shipped"}
    assert all(r["real_tokens_per_s"] > 0 and isinstance(r["config"], dict) and r["peak_gb"] for r in trl.values())


@pytest.mark.parametrize("name", ["qwen-2.5", "deepseek-r1-distill-llama-8b"])
def test_the_gpu_shapes_tokenizers_train_their_chats(tmp_path, name):
    """The GPU shapes' tokenizers (the miniature trains over a small one of its own): each loads from where the check
    takes it, with its template (TRL's marked Qwen2.5 one, leansft's Llama 3), and a synthetic chat of the check
    trains its answer up to the stop token."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_shapes

    from leansft.core.data.formats import Conversation
    from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, resolve_template
    from leansft.core.data.tokenizer import load_tokenizer

    tokenizers = {shape[6] for shape in gpu_shapes.SHAPES.values()}
    assert tokenizers == {"words-bpe", "qwen-2.5", "deepseek-r1-distill-llama-8b"}  # the miniature's, the GPU's
    tok = load_tokenizer(str(gpu_shapes.tokenizer_dir(name, tmp_path)))
    assert len(tok) > 128_000 and ("{% generation %}" in tok.chat_template) == (name == "qwen-2.5")
    chat = json.loads(gpu_shapes.write_chats(tmp_path / "chats.jsonl", 1).read_text())
    ((ids, labels),), = ChatEncoder(tok, resolve_template(tok, None)).encode([Conversation(chat["messages"], row=1)])
    stop = "<|im_end|>" if name == "qwen-2.5" else "<|eot_id|>"
    assert tok.decode(ids[labels != IGNORE_INDEX]) == chat["messages"][1]["content"] + stop


def test_a_benchmark_empties_only_a_work_folder_it_made(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import workdir

    theirs = tmp_path / "bench_trl"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="a benchmark did not make it"):
        workdir.fresh(theirs)
    assert (theirs / "notes.txt").read_text() == "mine"
    ours = workdir.fresh(tmp_path / "work")
    (ours / "model.bin").write_text("left by a run")
    assert workdir.fresh(ours) == ours and [p.name for p in ours.iterdir()] == [workdir.MARK]
