"""What the training loop asks of evaluation: eval loss, samples and the user's suites when due (at step 0 too,
the "before" picture), best tracking, early stopping and the forgetting warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from leansft.core import distributed
from leansft.core.inference.choices import choice_logprobs
from leansft.core.inference.generation import ChatSettings, generate, generate_greedy
from leansft.core.inference.heldout_loss import evaluate
from leansft.core.model.context_parallel import whole_rows
from leansft.core.progress import console, phase, plural
from leansft.core.model.vision_forward import vision_generation_inputs
from leansft.recipe import suites
from leansft.recipe.system_prompt import dominant_system_prompt

log = logging.getLogger("leansft")


def due(every: int | None, step: int, total: int) -> bool:
    """Every ``every`` steps, and at the first and last step."""
    return bool(every) and (step % every == 0 or step in (0, total))


def prompt_tail(text: str, limit: int = 160) -> str:
    """The end of a rendered prompt for the console: at most ``limit`` characters, starting at a line (else a
    word) where that is near, so a sample reads from its last turn's header instead of mid-word."""
    text = text.strip()
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    for sep in ("\n", " "):
        cut = tail.find(sep)
        if 0 <= cut < limit // 2:
            return "…" + tail[cut + 1 :]
    return "…" + tail


class Evaluator:
    def __init__(self, cfg, model, prep, device, amp, out: Path, sharded=None) -> None:
        self.cfg, self.model, self.prep, self.device, self.amp, self.out = cfg, model, prep, device, amp, out
        self.sharded = sharded  # the FSDP root: eval goes through it; samples are skipped
        self.last_eval_loss: float | None = None
        self.best: float | None = None
        self.bad_evals = 0
        self.should_stop = False
        self.console = console()
        trained = dominant_system_prompt(prep.report.as_dict())  # configured prompts get what the model learned under
        self.settings = ChatSettings(system=trained[0] if trained else None)
        self.suite_items = {s.name: suites.load_items(s, cfg.training.seed) for s in cfg.eval.suites}
        # the items a suite scores between the first and last step where it has limit_between (indices into its items)
        self.suite_between = {s.name: suites.subset(self.suite_items[s.name][0], s.limit_between, cfg.training.seed)
                              for s in cfg.eval.suites}
        # each suite's items' scores before training: from this run's log where a resumed run has them
        self.suite_base = {r["suite"]: [it.get("score") for it in r["items"]]
                           for r in reversed(suites.read_results(out)) if r["step"] == 0}

    def state(self) -> dict:
        """What a checkpoint keeps so early stopping continues exactly after a resume."""
        return {"last_eval_loss": self.last_eval_loss, "best": self.best, "bad_evals": self.bad_evals,
                "should_stop": self.should_stop}

    def restore(self, saved: dict) -> None:
        for key in ("last_eval_loss", "best", "bad_evals", "should_stop"):
            if key in saved:
                setattr(self, key, saved[key])

    def prompts(self) -> list:
        e = self.cfg.eval
        if e.prompts:
            return list(e.prompts)
        if self.prep.eval is None or e.num_samples == 0:
            return []
        n = min(e.num_samples, len(self.prep.eval))
        prompt_lengths = self.prep.eval.prompt_lengths
        # rendered prompts, each ending in the generation prompt
        return [self.prep.eval.example(i)[0][: prompt_lengths[i]].tolist() for i in range(n)]

    def prompt_images(self, prompts: list) -> list[dict] | None:
        """A vision model's held-out prompts' images, as ``generate`` passes them (None for text)."""
        if self.prep.images is None or self.cfg.eval.prompts:
            return None
        return [vision_generation_inputs(self.model, self.prep.eval, i, p) for i, p in enumerate(prompts)]

    def run_eval(self) -> dict:
        with whole_rows(self.model):  # every rank evaluates whole rows (context parallelism splits training's)
            return evaluate(self.model, self.prep.eval, self.cfg.data.max_length,
                            self.cfg.batching.tokens_per_micro_batch, self.cfg.training.loss_chunk_size, self.device,
                            self.amp, self.sharded)

    def after_step(self, step: int, total: int) -> dict | None:
        """Run what is due at ``step`` (0 = before training): samples are written, eval fields returned."""
        result = self.maybe_eval(step, total)
        self.maybe_sample(step, total)
        scores = self.maybe_suites(step, total)
        return {**(result or {}), **scores} if scores else result

    def maybe_suites(self, step: int, total: int) -> dict | None:
        """The suites when due (before step 1, every suites_every steps, after the last): their records appended to
        suites.jsonl, their scores returned for the metrics line, a fall below the base model's score warned."""
        e = self.cfg.eval
        if not e.suites or not (step in (0, total) or (e.suites_every and step % e.suites_every == 0)):
            return None
        if self.sharded is not None:
            if step == 0:
                log.warning("eval.suites do not run under FSDP (sharded weights); export and use leansft eval")
            return None

        autocast = torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None)
        tokenizer, template = self.prep.tokenizer, self.prep.template

        def answer(prompts: list, max_new_tokens: int) -> list[str]:
            with autocast:
                return generate_greedy(self.model, tokenizer, template, prompts, max_new_tokens=max_new_tokens,
                                       settings=self.settings)

        def choices(requests: list) -> list:
            with autocast:
                return choice_logprobs(self.model, tokenizer, requests)

        model = suites.Model(answer=answer, render=lambda p: self.settings.render(tokenizer, template, p),
                             choices=choices)
        scores = {}
        for suite in e.suites:
            items, skipped = self.suite_items[suite.name]
            between = step not in (0, total) and len(self.suite_between[suite.name]) < len(items)
            picked = self.suite_between[suite.name] if between else list(range(len(items)))
            with phase(f"step {step}: suite {suite.name}, {plural(len(picked), 'item')}"):
                record = {"step": step, **suites.run_suite(suite, [items[k] for k in picked], model, skipped),
                          "subset": between}
            if step == 0:
                self.suite_base.setdefault(suite.name, [it.get("score") for it in record["items"]])
            base = [self.suite_base[suite.name][k] for k in picked] if suite.name in self.suite_base else []
            before = float(sum(base) / len(base)) if base and None not in base else None
            record["forgetting"] = (before is not None and record["score"] is not None
                                    and record["score"] < before - e.forgetting_margin)
            if record["forgetting"] and distributed.rank() == 0:
                log.warning("forgetting: suite %s (%s) at %.3f at step %d, %.3f before training%s (more than "
                            "eval.forgetting_margin %g below)", suite.name, record["metric"], record["score"], step,
                            before, f" on the same {len(picked)} items" if between else "", e.forgetting_margin)
            if distributed.rank() == 0:
                with (self.out / suites.RESULTS).open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(record) + "\n")
                shown = "answers written" if record["score"] is None else f"{record['score']:.3f}"
                self.console.print(f"[dim]step {step}[/] suite {suite.name}: {record['metric']} {shown} "
                                   f"({record['n']} items{', a sample' if between else ''})")
            if record["score"] is not None:
                scores[f"suite_{suite.name}" + ("_sample" if between else "")] = record["score"]
        return scores

    def maybe_eval(self, step: int, total: int) -> dict | None:
        if self.prep.eval is None or not due(self.cfg.eval.eval_every, step, total):
            return None
        with phase(f"step {step}: held-out eval of {len(self.prep.eval):,} examples"
                   + (" (the before picture)" if step == 0 else "")):
            result = self.run_eval()
        self.last_eval_loss = result["eval_loss"]
        if self.best is None or result["eval_loss"] < self.best:
            self.best, self.bad_evals = result["eval_loss"], 0
        else:
            self.bad_evals += 1
            patience = self.cfg.eval.early_stopping_patience
            self.should_stop = bool(patience and self.bad_evals >= patience)
        return result

    def maybe_sample(self, step: int, total: int) -> list[str] | None:
        if not due(self.cfg.eval.samples_every, step, total):
            return None
        prompts = self.prompts()
        if not prompts:
            return None
        if self.sharded is not None:
            if step == 0:
                log.warning("samples are not generated under FSDP (sharded weights); export and use leansft generate")
            return None
        e = self.cfg.eval
        with phase(f"step {step}: sampling {plural(len(prompts), 'answer')}"), \
                torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):  # as the run computes
            answers = generate(self.model, self.prep.tokenizer, self.prep.template, prompts,
                               max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p,
                               seed=self.cfg.training.seed, settings=self.settings, inputs=self.prompt_images(prompts))
        if distributed.rank() == 0:
            with (self.out / "samples.jsonl").open("a") as fh:
                for p, a in zip(prompts, answers):
                    text = p if isinstance(p, str) else self.prep.tokenizer.decode(p) if not isinstance(p[0], dict) \
                        else p[-1]["content"]
                    fh.write(json.dumps({"step": step, "prompt": text, "answer": a}) + "\n")
                    self.console.print(f"[dim]step {step} sample:[/] {prompt_tail(text)!r}\n  [bold]-> {a!r}[/]")
        return answers

    def print_record(self, r: dict) -> None:
        parts = [f"step {r['step']}"]
        if "loss" in r:
            parts += [f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}",
                      f"{r['real_tokens_per_s']:,.0f} tok/s", f"pad {r['padding_share']:.1%}"]
            if r.get("mfu") is not None:
                parts.append(f"mfu {r['mfu']:.1%}")
        if "eval_loss" in r:
            parts += [f"eval_loss {r['eval_loss']:.4f}", f"ppl {r['eval_perplexity']:.2f}"]
            if r.get("eval_token_accuracy") is not None:
                parts.append(f"acc {r['eval_token_accuracy']:.1%}")
        self.console.print("  ".join(parts))
