"""The modules of the GPU check recipe; ``recipes/gpu_check.py`` is its entry point."""
