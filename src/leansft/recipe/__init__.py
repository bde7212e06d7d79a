"""The recipe layer: builders and the training loop (``train``). Uses the core; used only by the tools."""
