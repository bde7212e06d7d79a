"""Data preparation at scale: parallel shards give the same bytes as one process, turns are found in linear
time with exactly the masks the prefix method gives, and training reads the memory-mapped cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import trl_template, write_jsonl
from test_tools import WEATHER

from leansft.core.config import DataConfig
from leansft.core.data import masking, shards
from leansft.core.data.dataset import TokenizedDataset, build_dataset
from leansft.core.data.formats import convert_row
from leansft.core.data.masking import ChatEncoder, resolve_template
from leansft.core.errors import DataError

WORDS = "alpha beta gamma delta the of and to in is it".split()


def synthetic_rows(n: int, seed: int = 0, tools: bool = True) -> list[dict]:
    """Chats of 1-6 turns (some with a system prompt) and, with ``tools``, agent traces of 1-5 tool rounds."""
    rng = random.Random(seed)

    def say() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))).capitalize() + "."

    rows = []
    for i in range(n):
        if tools and i % 3 == 2:
            m = [{"role": "user", "content": say()}]
            for r in range(rng.randint(1, 5)):
                call = f"c{i:04d}{r:04d}"
                m += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": call, "type": "function", "function": {"name": "get_weather", "arguments": {"q": say()}}}]},
                      {"role": "tool", "tool_call_id": call, "name": "get_weather", "content": json.dumps({"t": r})}]
            rows.append({"tools": [WEATHER], "messages": m + [{"role": "assistant", "content": say()}]})
        else:
            m = [{"role": "system", "content": say()}] if i % 2 else []
            for _ in range(rng.randint(1, 6)):
                m += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
            rows.append({"messages": m})
    return rows


TEMPLATES = [("qwen25_path", None, True), ("llama3_path", trl_template("llama3_1"), True),
             ("mistral_v3_path", None, True), ("gemma3_path", None, False), ("tiny_bpe_path", None, False)]


@pytest.mark.parametrize("fixture,template,tools", TEMPLATES)
def test_linear_span_finding_gives_the_prefix_method_masks(request, load_tok, monkeypatch, fixture, template, tools):
    tok = load_tok(request.getfixturevalue(fixture))
    convs = [convert_row(r, "messages", "f", i + 1) for i, r in enumerate(synthetic_rows(24, tools=tools))]
    used = []
    window = ChatEncoder._window_spans

    def spy(self, *args):
        spans = window(self, *args)
        used.append(spans is not None)
        return spans

    monkeypatch.setattr(ChatEncoder, "_window_spans", spy)
    got = {}
    for min_turns in (1, 10**9):  # linear wherever it can vouch for the result / the prefix method everywhere
        monkeypatch.setattr(masking, "WINDOW_MIN_TURNS", min_turns)
        got[min_turns] = ChatEncoder(tok, resolve_template(tok, template)).encode(convs)
    for linear, prefix in zip(got[1], got[10**9]):
        assert len(linear) == len(prefix)
        for (a_ids, a_lab), (b_ids, b_lab) in zip(linear, prefix):
            assert np.array_equal(a_ids, b_ids) and np.array_equal(a_lab, b_lab)
    # Mistral's template moves the tools to the last user message: such conversations take the prefix path
    assert sum(used) >= (0.5 if fixture == "mistral_v3_path" else 1.0) * len(used)


def data_config(tmp_path: Path, sources: list[str], workers: int, **kw) -> DataConfig:
    return DataConfig(**{"sources": sources, "cache_dir": str(tmp_path / f"cache{workers}"), "num_workers": workers,
                         "max_length": 4096, **kw})


def cache_files(cfg: DataConfig) -> dict[str, bytes]:
    (folder,) = (Path(cfg.cache_dir) / "tokenized").iterdir()
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "meta.json"}


@pytest.mark.parametrize("limit,value", [("SHARD", 16), ("SHARD_BYTES", 3000)])  # shards cut by rows / by size
def test_one_and_two_workers_write_the_same_bytes(tmp_path, load_tok, qwen25_path, monkeypatch, limit, value):
    monkeypatch.setattr(shards, limit, value)  # several shards per worker
    rows = synthetic_rows(150)
    rows[40] = rows[3]  # a duplicate in another shard
    rows[77] = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}  # a bad row
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = load_tok(qwen25_path)
    built = {}
    for workers in (1, 2):
        cfg = data_config(tmp_path, [data], workers, on_bad_row="skip")
        built[workers] = build_dataset(cfg, tok, resolve_template(tok, None))
        assert built[workers][1].sources[0]["cache"] == "miss"
    assert cache_files(data_config(tmp_path, [data], 1)) == cache_files(data_config(tmp_path, [data], 2))
    (one, r1), (two, r2) = built[1], built[2]
    assert r1.as_dict() | {"sources": None} == r2.as_dict() | {"sources": None}
    assert r1.duplicates_removed == 1 and r1.sources[0]["bad_rows"] == 1 and r1.sources[0]["rows_read"] == 150
    assert {k: v for k, v in r1.sources[0].items() if k != "path"} == {k: v for k, v in r2.sources[0].items()
                                                                         if k != "path"}
    assert all(np.array_equal(a, b) for a, b in zip(one.flat(), two.flat()))
    # the cache key does not depend on the number of workers
    again = data_config(tmp_path, [data], 1, on_bad_row="skip").model_copy(update={"num_workers": 2})
    assert build_dataset(again, tok, resolve_template(tok, None))[1].sources[0]["cache"] == "hit"


def test_an_error_in_a_worker_names_file_and_row(tmp_path, load_tok, qwen25_path, monkeypatch):
    monkeypatch.setattr(shards, "SHARD", 8)
    rows = synthetic_rows(40, tools=False)
    rows[29] = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = load_tok(qwen25_path)
    with pytest.raises(DataError, match=r"d.jsonl: row 30: field 'messages\[1\].role': unknown role 'bot'"):
        build_dataset(data_config(tmp_path, [data], 2), tok, resolve_template(tok, None))


def test_datasets_are_index_arrays_over_the_memory_mapped_cache(tmp_path, load_tok, qwen25_path):
    data = write_jsonl(tmp_path / "d.jsonl", synthetic_rows(60))
    tok = load_tok(qwen25_path)
    cfg = data_config(tmp_path, [data, data], 1, max_length=64)
    cfg.sources[1].weight = 2.0
    ds, report = build_dataset(cfg, tok, resolve_template(tok, None))
    assert all(isinstance(a, np.memmap) for a in (*ds.store.ids, *ds.store.mask))
    assert ds.store.mask[0].dtype == np.uint8  # the loss mask: one byte per token, not a copy of the ids
    assert report.duplicates_removed == 120 and len(ds) + report.no_target_tokens == 60  # source 2 repeats 1
    assert ds.lengths.max() == 64 and report.truncated > 0
    for i in range(len(ds)):  # cut examples count their targets on what is left
        ids, labels = ds.example(i)
        assert len(ids) == ds.lengths[i] and ds.target_counts[i] == int((labels[1:] != -100).sum())


def test_progress_and_final_counts_are_logged(tmp_path, load_tok, qwen25_path, caplog):
    data = write_jsonl(tmp_path / "d.jsonl", synthetic_rows(10))
    tok = load_tok(qwen25_path)
    with caplog.at_level("INFO", logger="leansft"):
        build_dataset(data_config(tmp_path, [data], 1), tok, resolve_template(tok, None))
    assert any("prepared" in r.message and "10 conversations" in r.message and "tokens (" in r.message
               for r in caplog.records)


@pytest.mark.slow
def test_training_reads_the_memory_mapped_cache(tmp_path, tiny_run_assets, monkeypatch):
    from helpers import run_config

    from leansft.recipe.train import train

    gather = TokenizedDataset.tokens
    seen = []

    def checked(self, *args):
        seen.append(all(isinstance(a, np.memmap) for a in (*self.store.ids, *self.store.mask)))
        return gather(self, *args)

    monkeypatch.setattr(TokenizedDataset, "tokens", checked)
    train(run_config(tmp_path, tiny_run_assets, "training.max_steps=2", "data.eval_split=0.1", "eval.eval_every=2"))
    assert seen and all(seen)  # every batch (train and eval) gathered from the memory map, never from a copy


def test_parquet_is_read_in_batches_and_rows_keep_their_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from leansft.core.data.sources import read_rows

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(1, 10_001)]}), path, row_group_size=3000)
    rows = list(read_rows(str(path)))
    assert len(rows) == 10_000 and all(row["text"] == f"row {n}" for n, row in rows)
