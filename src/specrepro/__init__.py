"""specrepro: reproduce lossless LLM decoding-acceleration papers with one harness."""

__version__ = "0.1.0"
