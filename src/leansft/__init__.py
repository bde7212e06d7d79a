"""leansft: supervised fine-tuning of causal language models, lean and exact."""

__version__ = "0.1.0"
