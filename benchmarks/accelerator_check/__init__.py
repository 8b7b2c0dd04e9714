"""The accelerator check of the offload transforms (GPU or TPU); ``python -m benchmarks.accelerator_check``
runs it (see ``__main__``)."""
