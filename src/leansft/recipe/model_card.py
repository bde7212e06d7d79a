"""OUTPUT_DIR/final/README.md: a Hugging Face model card saying what the exported model is.

YAML header (base_model, library_name: peft for adapters alone, else transformers; tags, datasets where they
are Hub names, license when the base model states one), then: base model, method and its settings, data sources
with counts and the data report, max_length and packing, steps and tokens seen, final train and eval
loss/perplexity, samples before and after, hardware and real tokens/s, and the command that reproduces the run.
"""

from __future__ import annotations

import json
import math
import platform
import re
from pathlib import Path

import torch
import yaml

from leansft import __version__
from leansft.core.config import RunConfig, TrainingConfig
from leansft.core.paths import resolve_package_path
from leansft.recipe import suites
from leansft.recipe.report import run_totals


def base_license(model_spec: str) -> str | None:
    """The base model's license: its README's YAML header, or a GGUF file's ``general.license``."""
    path = Path(resolve_package_path(model_spec)) if model_spec.startswith("pkg:") else Path(model_spec)
    if path.is_file() and path.suffix == ".gguf":
        try:
            from leansft.core.gguf.metadata import read_metadata

            value = read_metadata(path, "general.license").get("general.license")
            return value if isinstance(value, str) else None
        except Exception:  # noqa: BLE001 - a license we cannot read is simply not stated
            return None
    readme = path / "README.md"
    if readme.is_file():
        m = re.match(r"---\n(.*?)\n---", readme.read_text(encoding="utf-8", errors="replace"), re.S)
        if m:
            header = yaml.safe_load(m.group(1)) or {}
            return header.get("license") if isinstance(header, dict) else None
    return None


def _hub_name(spec: str) -> bool:
    return not spec.startswith("pkg:") and not Path(spec).exists() and spec.count("/") == 1


def method_text(t: TrainingConfig) -> str:
    """The method row: its settings, and what the exported folder holds (merged weights, or adapters alone)."""
    variants = [v for v, on in (("DoRA", t.lora.use_dora), ("rsLoRA", t.lora.use_rslora),
                                 (f"LoRA+ ratio {t.lora.lr_ratio}", t.lora.lr_ratio), (f"init {t.lora.init}",
                                 t.lora.init != "default")) if on]
    lora = (f"(r={t.lora.r}, alpha={t.lora.alpha}, dropout={t.lora.dropout}, target modules "
            f"{t.lora.target_modules}{', ' + ', '.join(variants) if variants else ''})")
    if t.method == "lora":
        method = f"LoRA {lora}; " + ("the export merges the adapters into the base weights" if t.lora.merge_on_export
                                     else "the export holds the adapters alone, for PEFT to apply to the base model")
    elif t.method == "qlora":
        quant = f"{t.qlora.quant_type}, double quantisation {t.qlora.double_quant}"
        method = f"QLoRA: a 4-bit base ({quant}) with LoRA {lora}; " + (
            "the export merges the adapters into the dequantised 4-bit base weights" if t.lora.merge_on_export else
            "the export holds the adapters alone, trained against the 4-bit base: load the base quantised the same "
            f"way ({quant}) for PEFT to apply them to the model that was trained")
    else:
        method = "full fine-tuning"
    if t.neftune_noise_alpha:
        method += f"; NEFTune noise alpha {t.neftune_noise_alpha}"
    return method


def model_card(cfg: RunConfig, out: Path, records: list[dict], samples: list[dict], data_report: dict) -> str:
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    last = train[-1] if train else {}
    adapters_alone = cfg.training.method in ("lora", "qlora") and not cfg.training.lora.merge_on_export
    header = {"base_model": cfg.model if _hub_name(cfg.model) else None,
              "library_name": "peft" if adapters_alone else "transformers",  # what loads the folder (the Hub's)
              "tags": ["leansft", "sft", cfg.training.method], "license": base_license(cfg.model),
              "datasets": [s.path for s in cfg.data.sources if _hub_name(s.path)] or None,
              "pipeline_tag": "text-generation"}
    header = {k: v for k, v in header.items() if v is not None}
    t = cfg.training
    method = method_text(t)
    lines = ["---", yaml.safe_dump(header, sort_keys=False).strip(), "---", "",
             f"# {cfg.logging.run_name or out.name}", "",
             f"Supervised fine-tuning of `{cfg.model}` with leansft "
             f"{__version__}: loss on assistant tokens only ({cfg.data.loss_on}).", "",
             "## Training", "", "| | |", "| --- | --- |",
             f"| base model | `{cfg.model}` |", f"| method | {method} |",
             f"| optimizer | AdamW, lr {t.learning_rate:g}, {t.schedule} schedule, weight decay {t.weight_decay:g} |",
             f"| max_length | {cfg.data.max_length} |",
             f"| batching | {cfg.batching.strategy}, {cfg.batching.tokens_per_micro_batch} tokens per micro-batch, "
             f"gradient accumulation {cfg.batching.gradient_accumulation} |",
             f"| steps | {last.get('step', 0)} |", f"| tokens seen | {last.get('tokens_seen', 0):,} |",
             f"| examples seen | {last.get('examples_seen', 0):,} |"]
    if last:
        lines.append(f"| final train loss | {last['loss']:.4f} |")
    if evals:
        e0, e1 = evals[0], evals[-1]
        lines.append(f"| eval loss | {e0['eval_loss']:.4f} (step {e0['step']}) -> {e1['eval_loss']:.4f} "
                     f"(step {e1['step']}); perplexity {math.exp(min(e1['eval_loss'], 50)):.2f} |")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86-64'})"
    totals = run_totals(records)
    if totals:
        lines.append(f"| hardware, throughput | {device}; {totals['run_real_tokens_per_s']:,.0f} real tokens/s "
                     f"(run average), {totals['run_wall_s']:,.0f} s wall |")
    before_after = suites.section(suites.read_results(out), answers=False)
    if before_after:
        lines += ["", "## Evaluation before and after", "", *before_after]
    lines += ["", "## Data", ""]
    for src, rep in zip(cfg.data.sources, data_report.get("sources", [])):
        lines.append(f"- `{src.path}` ({rep.get('format', src.format)}, weight {src.weight:g}): "
                     f"{rep.get('rows_read', '?')} rows read, {rep.get('examples', '?')} examples")
    kept = {k: v for k, v in data_report.items() if k not in ("sources", "length_histogram")}
    lines += ["", "Cleaning and length handling: `" + json.dumps(kept) + "`"]
    if samples:
        first, final = samples[0]["step"], samples[-1]["step"]
        lines += ["", f"## Samples (step {first} -> step {final})", ""]
        before = [s for s in samples if s["step"] == first]
        after = [s for s in samples if s["step"] == final]
        for b, a in zip(before, after):
            lines += [f"- **prompt:** {b['prompt'][-300:]!r}", f"  - before: {b['answer']!r}",
                      f"  - after: {a['answer']!r}"]
    lines += ["", "## Reproduce", "", "```bash", f"leansft train {out / 'config.yaml'}", "```", "",
              "(the resolved config of this run; `pip install leansft` first)"]
    return "\n".join(lines) + "\n"


def write_model_card(cfg: RunConfig, out: Path, final: Path, records: list[dict], samples: list[dict],
                     data_report: dict) -> Path:
    card = final / "README.md"
    card.write_text(model_card(cfg, out, records, samples, data_report))
    return card
