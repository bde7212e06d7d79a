"""Rows -> conversations -> rendered, masked, tokenised examples (cached, memory-mapped): ``prepare_data``."""
