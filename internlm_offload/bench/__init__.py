"""Benchmark scripts, run as `python -m internlm_offload.bench.<name>`; the library never imports them."""
