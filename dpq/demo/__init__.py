"""The embedded default: a tiny Llama the package builds, its tokenizer and calibration data."""
