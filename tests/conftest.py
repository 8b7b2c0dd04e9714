"""Test configuration: 8 virtual CPU devices (for mesh tests), strict numerics settings."""

import importlib.util
import mmap
import os
import pathlib


def _xla_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA defines ``flag`` (an unknown flag in XLA_FLAGS aborts
    the process, so a flag that a later XLA drops must not be passed)."""
    name = flag.split("=")[0].lstrip("-").encode()
    for lib in pathlib.Path(importlib.util.find_spec("jaxlib").origin).parent.glob("*.so"):
        with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(name) >= 0:
                return True
    return False


# Must happen before jax initialises its backends. The suite is dominated by XLA compile time
# of tiny programs, so the CPU backend's expensive optimisation passes are switched off, and
# its older fusion emitters are used where this XLA still has them (they compile these programs
# about three times faster). The numbers agree with the default backend's to float32 rounding.
# Each program's LLVM module is compiled in one piece: split for parallel code generation, these
# small modules cost more CPU time in all (about a sixth of the compile time here), and the suite's
# two processes keep both cores busy anyway. (Code generation only: the same code, the same numbers.)
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
_OPTIONAL_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
for _flag in _FLAGS + tuple(f for f in _OPTIONAL_FLAGS if _xla_knows(f)):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Recipe tests build the same programs in many runs and subprocesses: a persistent compilation
# cache, fresh for each test session (inherited by subprocesses through the environment), makes
# every compile after the first a lookup.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jax-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
