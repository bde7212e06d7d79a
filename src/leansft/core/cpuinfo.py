"""The CPU's vendor and feature flags from /proc/cpuinfo, read without torch (some callers run before it loads)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields (``vendor_id``, ``flags``, ...); empty where /proc/cpuinfo is unreadable."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_vendor() -> str:
    """'GenuineIntel', 'AuthenticAMD', ...; '' where there is none to read."""
    return cpu_fields().get("vendor_id", "")


def cpu_flags() -> frozenset[str]:
    """The kernel's CPU feature flags (``avx512f``, ``amx_tile``, ...)."""
    return frozenset(cpu_fields().get("flags", "").split())
