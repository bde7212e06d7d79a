"""Every example config runs as shipped: its model and data resolve from the repository and the installed
packages, and it trains one step (made small: one short micro-batch, no eval, no export, the precision this machine
computes natively: a config's bf16 is emulated on a CPU without bf16 units, 33 s of CPU for the 135M model's one
backward there; bf16 training on the CPU is test_engine's and test_bf16_base's, on tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leansft.core.config import load_config
from leansft.recipe.train import train

# every config, not the dataset registry beside them (examples/datasets.yaml, which their sources may name)
EXAMPLES = sorted(p for p in (Path(__file__).parents[1] / "examples").glob("*.yaml") if p.name != "datasets.yaml")
SMALL = ["training.max_steps=1", "data.max_length=128", "batching.tokens_per_micro_batch=128",
         "batching.gradient_accumulation=1", "eval.eval_every=null", "eval.samples_every=null",
         "checkpoint.export=false", "training.gradient_checkpointing=false", "eval.suites=[]", "training.precision=auto"]


@pytest.fixture(scope="module")
def cache() -> Path:
    """leansft's own cache (as a user's run has it): the bundled SmolLM2 GGUF is converted into it once for every
    test and run that reads it (18 s of CPU a conversion), and the examples' data are prepared once."""
    from leansft.core.paths import default_cache_dir

    return default_cache_dir()


def test_every_example_says_what_it_is_in_its_first_line():
    for path in EXAMPLES:
        assert path.read_text().startswith("# "), path.name


# vision.yaml trains on what examples/vision/make_demo.py makes first: test_vision.py makes it and trains that config
AS_SHIPPED = [p for p in EXAMPLES if p.name != "vision.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("path", AS_SHIPPED, ids=[p.stem for p in AS_SHIPPED])
def test_each_example_trains_one_step_as_shipped(path, tmp_path, cache):
    cfg = load_config(str(path), [*SMALL, f"output_dir={tmp_path / 'run'}", f"data.cache_dir={cache}"])
    assert train(cfg)["step"] == 1
