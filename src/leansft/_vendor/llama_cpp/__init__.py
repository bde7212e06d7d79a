"""llama.cpp's HF -> GGUF converter and gguf package, vendored by scripts/vendor_llama_cpp.py (see README.md)."""
