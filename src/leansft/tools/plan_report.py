"""Show a plan: a terminal table (rich) and a length histogram (matplotlib)."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from leansft.core.data.content_tokens import special_in_content
from leansft.core.progress import console as shared_console
from leansft.core.progress import plural


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def template_summary(stats: dict) -> str:
    """One line on what a source's rendering held: tool calls and results, thinking, per-turn expansion."""
    parts = [f"{stats.get('assistant_turns', 0):,} assistant turns"]
    stops = {k.removeprefix("stop "): v for k, v in stats.items() if k.startswith("stop ")}
    if stops:
        parts.append("ended by " + ", ".join(f"{t} x{n:,}" for t, n in sorted(stops.items(), key=lambda kv: -kv[1])))
    if stats.get("tool_call_turns") or stats.get("tool_results"):
        parts.append(f"{stats.get('tool_call_turns', 0):,} with tool calls, {stats.get('tool_results', 0):,} tool results")
    if stats.get("thinking_turns"):
        parts.append(f"{stats['thinking_turns']:,} with thinking ({stats['thinking_tokens']:,} thinking tokens trained)")
    if stats.get("per_turn_conversations"):
        parts.append(f"per-turn: {stats['per_turn_conversations']:,} conversations -> {stats['per_turn_examples']:,} "
                     f"examples (+{stats['per_turn_extra_tokens']:,} repeated context tokens)")
    found = special_in_content(stats)
    if found:
        parts.append(found)
    return "; ".join(parts)


def cleaning_line(prep: dict) -> str | None:
    """What preparation removed before the plan's counts, or None: conversations in, examples out."""
    parts = [plural(prep[k], label) + " removed" for k, label in (
        ("duplicates_removed", "duplicate"), ("too_short", "example below min_tokens"),
        ("too_long", "example above max_tokens"), ("no_target_tokens", "example without target tokens"))
        if prep.get(k)]
    return "; ".join(parts) or None


def print_plan(summary: dict, console: Console | None = None) -> None:
    console = console or shared_console()
    prep = summary.get("preparation", {})
    for src in prep.get("sources", []):
        if src.get("template"):
            console.print(f"{src['path']}: {template_summary(src['template'])}")
        if src.get("streaming"):
            console.print(f"{src['path']}: streaming ({plural(src['files'], 'file')}, a resume seeks it by "
                          f"{src['seeks_by']}), {src['share_asked']:.1%} of the mix asked, "
                          f"{src['examples_in_first_window']:,} examples in the first window")
        elif src.get("share_asked") is not None:  # data.mix.mode: interleave
            console.print(f"{src['path']}: {src['share_got']:.1%} of the mix's {src['share_of']} (asked "
                          f"{src['share_asked']:.1%}), "
                          f"{src['mix_examples']:,} examples, {src['mix_target_tokens']:,} target tokens; each example "
                          f"{src['times_seen']:g} times on average")
    cleaned = cleaning_line(prep)
    if cleaned:
        console.print(f"cleaning: {cleaned}")
    if summary.get("stream"):
        st = summary["stream"]
        console.print(f"streaming: the figures below are the first window's ({st['window']:,} examples). Packed a "
                      f"window at a time, rows are {st['fill_per_window']:.1%} full over the first "
                      f"{plural(st['windows'], 'window')}, {st['fill_together']:.1%} were their "
                      f"{st['examples']:,} examples packed together: the window costs "
                      f"{st['fill_together'] - st['fill_per_window']:.1%} of fill (raise data.stream.window to pack "
                      "fuller, at more memory)")
    ls = summary["lengths"]
    head = f"[bold]{summary['examples']:,}[/] {'example' if summary['examples'] == 1 else 'examples'}, " \
           f"{summary['tokens']:,} tokens"
    if summary.get("target_tokens") is not None:
        head += f", {summary['target_tokens']:,} target tokens ({summary['loss_share']:.1%} carry loss)"
    console.print(head)
    if summary.get("images") and summary["images"]["images"]:
        im = summary["images"]
        size = (f" ({im['pixels_per_image_max']:,} pixels); resolution limits {im['min_pixels']:,} to "
                f"{im['max_pixels']:,} pixels (vision.min_pixels / max_pixels)" if im["max_pixels"] else
                " (every image resized to one size)")
        console.print(f"images: {im['images']:,} in {im['examples_with_images']:,} examples; {im['image_tokens']:,} "
                      f"image tokens ({im['image_token_share']:.1%} of all, none carry loss); per image "
                      f"{im['tokens_per_image_mean']:.0f} tokens on average, at most {im['tokens_per_image_max']:,}"
                      + size)
    console.print(
        f"length mean {ls['mean']:.0f}  median {ls['median']:.0f}  p90 {ls['p90']:.0f}  p99 {ls['p99']:.0f}  "
        f"max {ls['max']}"
    )
    cut = summary["truncated"]
    console.print(
        f"max_length {summary['max_length']} truncates {plural(cut, 'example')}; "
        f"recommended max_length: [bold]{summary['recommended_max_length']}[/]"
    )
    if cut:
        console.print(f"[yellow]note:[/] the attention work and rows below are for the examples cut at max_length "
                      f"{summary['max_length']} (the longest has {ls['max']:,} tokens)")
    micro = summary.get("tokens_per_micro_batch")
    t = Table(title=f"batching strategies (batch size {summary['batch_size']} for padded/sorted"
                    + (f", {micro:,} tokens per packed micro-batch)" if micro else ")"))
    for col in ("strategy", "real-token share", "attention work", "rows/batches", "micro-batches", "truncated",
                "split/cut"):
        t.add_column(col, justify="right" if col != "strategy" else "left")
    for name, s in summary["strategies"].items():
        t.add_row(name, f"{s['real_token_share']:.1%}", f"{s['attention_work_ratio']:.2f}x", f"{s['rows']:,}",
                  f"{s.get('micro_batches', s['rows']):,}", f"{s['truncated']:,}", f"{s['split']:,}")
    console.print(t)
    console.print("real-token share: real tokens over the positions computed, as train logs it (pad = 1 - share); "
                  "packed strategies pad nothing")
    if "wrapped" in summary["strategies"]:
        console.print("[yellow]note:[/] wrapped cuts examples mid-sequence (responses lose their start or end)")
    mem = summary.get("memory")
    if mem:
        split = mem.get("context_parallel", 1)
        mt = Table(title=f"memory estimate: {mem['method']}, {mem['tokens']:,} tokens per micro-batch, {mem['precision']}"
                         + (f", per rank of context_parallel {split}" if split > 1 else ""))
        mt.add_column("part")
        mt.add_column("bytes", justify="right")
        for k, v in mem["parts"].items():
            mt.add_row(k + (" (dominant)" if k == mem["dominant"] else ""), _gb(v))
        mt.add_row("[bold]total[/]", _gb(mem["total"]))
        console.print(mt)
        console.print(
            f"activations with/without checkpointing: {_gb(mem['activations_with_checkpointing'])} / "
            f"{_gb(mem['activations_without_checkpointing'])}; the loss's logits: chunked {_gb(mem['logits_chunked'])}, "
            f"a model's own loss {_gb(mem['logits_full_loss'])} (logits, fp32 log-softmax and its gradient)"
        )
        if "recommended_context_parallel" in mem:
            n = mem["recommended_context_parallel"]
            console.print(f"on {_gb(mem['device_memory'])} a device: " + (
                "no context-parallel size the heads allow fits; lower max_length or tokens_per_micro_batch, or use "
                "gradient checkpointing" if n is None else "fits whole" if n == 1 else
                f"recommended distributed.context_parallel: {n} (each rank holds 1/{n} of a row)"))


def plot_lengths(lengths: np.ndarray, path: str, max_length: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(lengths, bins=min(100, max(10, len(lengths) // 20)), color="#4477aa")
    for q, style in ((50, "-"), (90, "--"), (99, ":")):
        v = np.percentile(lengths, q)
        ax.axvline(v, color="black", linestyle=style, label=f"p{q} = {v:.0f}")
    if max_length:
        ax.axvline(max_length, color="red", label=f"max_length = {max_length}")
    ax.set_xlabel("tokens per example (with chat template)")
    ax.set_ylabel("examples")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
