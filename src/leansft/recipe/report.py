"""A run's report: loss/lr/throughput plots and a one-page Markdown summary (report.png, report.md), and the run
page written once (report.html: the live page's renderer with the run's figures inside, ``recipe/run_page``).

Written at the end of training (and handed to the trackers); ``leansft report RUN_DIR`` rewrites it and
prints the before/after summary."""

from __future__ import annotations

from pathlib import Path

from leansft.core.errors import LeanSFTError
from leansft.core.progress import console
from leansft.recipe import suites
from leansft.recipe.metrics_log import read_jsonl
from leansft.recipe.run_page.page import static_html
from leansft.recipe.run_page.state import run_state


def schedule_curve(run: Path, train: list[dict]) -> tuple[list[int], list[float]] | None:
    """(steps, learning rate) at every step of the run, from its config.yaml's schedule (the optimizer's own
    function); None where the run folder has no readable config, or the curve misses a logged rate (a run whose
    length the config does not give, stopped early)."""
    from types import SimpleNamespace

    import yaml

    from leansft.recipe.schedule import lr_lambda, warmup_steps

    try:
        training = SimpleNamespace(**yaml.safe_load((run / "config.yaml").read_text())["training"])
        total = training.max_steps or max(r["step"] for r in train)
        f = lr_lambda(training.schedule, warmup_steps(training, total), total)
        lr = float(training.learning_rate)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    steps = list(range(1, total + 1))
    rates = [lr * f(s - 1) for s in steps]
    exact = all(abs(rates[r["step"] - 1] - r["lr"]) <= 1e-9 * lr for r in train if 0 < r["step"] <= total)
    return (steps, rates) if exact else None


def write_report(run: Path, quiet: bool = False) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(run / "metrics.jsonl")
    if not records:
        raise LeanSFTError("no metrics.jsonl (or it is empty): not a leansft run folder", file=str(run))
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    tokens_at = {r["step"]: r.get("tokens_seen", 0) for r in train}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["tokens_seen"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        axes[0].plot([tokens_at.get(r["step"], 0) for r in evals], [r["eval_loss"] for r in evals], "o-",
                     label="eval loss")
    axes[0].set_xlabel("tokens seen")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    curve = schedule_curve(run, train)
    if curve is not None:  # every step's rate: a warm-up shorter than log_every still shows
        axes[1].plot(*curve, label="schedule")
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train], "o", markersize=3, label="logged")
    axes[1].legend()
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("learning rate")
    axes[2].plot([r["step"] for r in train], [r["real_tokens_per_s"] for r in train], label="real tokens/s")
    axes[2].plot([r["step"] for r in train], [r["target_tokens_per_s"] for r in train], label="target tokens/s")
    axes[2].set_xlabel("step")
    axes[2].legend()
    fig.tight_layout()
    png = run / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)

    last = train[-1] if train else {}
    lines = [f"# leansft run: {run}", "", "![curves](report.png)", "", "## Final metrics", "",
             "| metric | value |", "| --- | --- |"]
    for k in ("step", "loss", "real_tokens_per_s", "target_tokens_per_s", "padding_share", "tokens_seen",
              "peak_memory_bytes", "mfu"):
        if k in last and last[k] is not None:
            v = last[k]
            text = (f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}") if isinstance(v, float) else f"{v:,}"
            lines.append(f"| {k} | {text} |")
    totals = run_totals(records)
    if totals:
        lines.append(f"| run wall time | {totals['run_wall_s']:,.1f} s ({totals['run_step_s']:,.1f} s in training "
                     "steps) |")
        lines.append(f"| run real tokens/s | {totals['run_real_tokens_per_s']:,.1f} ({totals['run_real_tokens']:,} "
                     "tokens / time in steps; real_tokens_per_s above is the last window's) |")
        lines.append(f"| run target tokens/s | {totals['run_target_tokens_per_s']:,.1f} |")
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        lines.append(f"| first eval_loss | {evals[0]['eval_loss']:.4f} (step {evals[0]['step']}) |")
        lines.append(f"| last eval_loss | {evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']}) |")
        lines.append(f"| best eval_loss | {best['eval_loss']:.4f} (step {best['step']}) |")
    before_after = suites.section(suites.read_results(run))
    if before_after:
        lines += ["", "## Suites before and after training", "", *before_after]
    samples = read_jsonl(run / "samples.jsonl")
    if samples:
        step = samples[-1]["step"]
        lines += ["", f"## Last samples (step {step})", ""]
        for s in samples:
            if s["step"] == step:
                lines += [f"- **prompt:** {s['prompt'][-300:]!r}", f"  **answer:** {s['answer']!r}"]
    cfg = run / "config.yaml"
    if cfg.exists():
        lines += ["", "## Config", "", "```yaml", cfg.read_text().rstrip(), "```"]
    md = run / "report.md"
    md.write_text("\n".join(lines) + "\n")
    html = run / "report.html"  # the live run page's renderer, its data inside: opens from disk
    html.write_text(static_html([run_state(run.name, run)]), encoding="utf-8")
    if not quiet:
        print_summary(train, evals, samples, totals)
    return [png, md, html]


def run_totals(records: list[dict]) -> dict | None:
    """The final record train() writes with the run's totals, if the run got that far."""
    return next((r for r in reversed(records) if "run_wall_s" in r), None)


def print_summary(train: list[dict], evals: list[dict], samples: list[dict], totals: dict | None = None) -> None:
    """Console summary: eval loss before/after, throughput, and the first vs last samples side by side."""
    c = console()
    if evals:
        c.print(f"[bold]eval loss[/] {evals[0]['eval_loss']:.4f} (step {evals[0]['step']}) -> "
                f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})")
    if train:
        rate = (f"{totals['run_real_tokens_per_s']:,.0f} (run average: tokens / time in steps; wall "
                f"{totals['run_wall_s']:,.0f} s)" if totals else
                f"{train[-1]['real_tokens_per_s']:,.0f} (last logged window)")
        c.print(f"[bold]real tokens/s[/] {rate}; padding share {train[-1]['padding_share']:.1%}; "
                f"tokens seen {train[-1]['tokens_seen']:,}")
    if samples:
        first, last = samples[0]["step"], samples[-1]["step"]
        before = [s for s in samples if s["step"] == first]
        after = [s for s in samples if s["step"] == last]
        for b, a in zip(before, after):
            c.rule()
            c.print(f"[bold]prompt:[/] {b['prompt'][-240:].strip()}")
            c.print(f"[dim]step {first}:[/] {b['answer']}")
            c.print(f"[green]step {last}:[/] {a['answer']}")
