"""Benchmarks: ``python -m benchmarks.zoo_cpu`` (CPU speed and compile time against transformers) and
``python -m benchmarks.accelerator_check`` (the GPU validation of the offload transforms). Results go to
``benchmarks/results/``. Run from the repository root."""
