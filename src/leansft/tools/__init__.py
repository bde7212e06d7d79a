"""The tools layer: the CLI and what it runs besides training (plan, simulate, show-mask, doctor, report,
eval/generate/chat). Uses the recipe and the core; nothing imports it."""
