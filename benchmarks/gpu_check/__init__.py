"""The GPU check of the offload transforms; ``python -m benchmarks.gpu_check`` runs it (see ``__main__``)."""
