"""Sub-commands that need a model (train, eval, generate, doctor, report) register here."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    return None
