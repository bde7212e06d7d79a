"""A benchmark's data from the Hugging Face Hub when no local copy is named: the dataset repository's files as
``huggingface_hub`` keeps them (its cache first; with ``HF_HUB_OFFLINE=1`` the cache only), in the layout the local
readers take. Nothing else fetches: a machine without the Hub and without a cached copy gets one line saying where to
put the data."""

from __future__ import annotations

from pathlib import Path

from leansft.core.errors import LeanSFTError


def snapshot(repo: str, patterns: list[str], ignore: list[str], advice: str) -> Path:
    """The local folder of dataset ``repo`` (only the files ``patterns`` match), or one line with ``advice``."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, repo_type="dataset", allow_patterns=patterns, ignore_patterns=ignore))
    except Exception as e:  # noqa: BLE001 - offline, unreachable, gated, missing: the same advice
        raise LeanSFTError(f"{advice} (the Hub's {repo}: {type(e).__name__}, not reachable or cached here)") from None
