"""What every test process shares: one intra-op thread each.

`make test` runs one pytest worker per core, and the train.py runs the tests start take one thread each
(tests/e2e/runner.py). With torch's default, a thread per core in every worker, the OpenMP threads of the two
workers spin waiting for each other on two cores: tests/unit/test_activation_offload.py took 145 s of CPU
that way against 9.5 s with one thread, same results. A value set outside (`OMP_NUM_THREADS=4 pytest ...`) is
kept, and the processes the tests start inherit it.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The kernel choice CI sets (tests/README.md): named at the top of every run, as it decides the last bits.
KERNEL_VARIABLES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY")


def pytest_report_header(config) -> str:
    import torch

    chosen = ", ".join(f"{name}={os.environ[name]}" for name in KERNEL_VARIABLES if name in os.environ)
    return f"cpu kernels: {torch.backends.cpu.get_cpu_capability()} ({chosen or 'the CPU default'})"
