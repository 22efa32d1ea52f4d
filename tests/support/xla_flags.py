"""The XLA flags of every process the suite runs. Its time is compile time: thousands of small
programs, each compiled once and run for milliseconds. LLVM at -O0 without XLA's fusion emitters,
each program in one part, compiles them several times as fast (docs/testing.md has the figures)
and changes results only in their last bits, the same way in every program the suite compares.
What users run, default flags, is what the 120B dry run and the docs' own commands compile with."""

# The last: LLVM's code generation in one part a program, where XLA:CPU splits it into up to 32
# to generate them in parallel; each part's code takes memory mappings of its own, which a worker
# holding many programs can run out of (tests/conftest.py). It changes no result.
QUICK_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
# XLA's defaults for what QUICK_COMPILE changes in results and run time (the split changes neither
# and stays one part), as `compiler_options` for a program whose expected values are the exact bits
# users' processes compute (tests/unit/test_modules.py's frozen values), or one that runs far longer
# than it compiles (tests/unit/test_int8.py's 150 training steps).
DEFAULT_COMPILE = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def xla_flags(devices: int, quick: bool = True) -> str:
    """XLA_FLAGS for a process of the suite with `devices` fake CPU devices; `quick=False` for one
    that runs far longer than it compiles."""
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *(QUICK_COMPILE if quick else ())])
