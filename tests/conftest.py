"""What every test process shares: one intra-op thread each, and the CPU kernels it runs.

`make test` runs one pytest worker per core, and the train.py runs the tests start take one thread each
(tests/e2e/runner.py). With torch's default, a thread per core in every worker, the OpenMP threads of the two
workers spin waiting for each other on two cores: tests/unit/test_activation_offload.py took 145 s of CPU
that way against 9.5 s with one thread, same results. A value set outside (`OMP_NUM_THREADS=4 pytest ...`) is
kept, and the processes the tests start inherit it.

`TEST_SHIFTED_KERNELS` moves the kernels off the CPU's own (tests/README.md, "Bitwise, or a tolerance"): `all` for
every test process, `half` for pytest-xdist's second worker only (a claim that holds only with one kernel choice
goes red whenever its file lands there, at half the shifted kernels' cost). Set before torch is imported, so the
worker's own tests and every run they start (the fork server included) take them.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# MKL's reproducible code path instead of the one tuned to the CPU, ATen's AVX2 kernels instead of AVX-512 ones
SHIFTED_KERNELS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
SHIFTED_WORKERS = {"all": None, "half": "gw1"}


def _shift_kernels() -> None:
    """Put `SHIFTED_KERNELS` in this process's environment where `TEST_SHIFTED_KERNELS` asks it of this worker."""
    choice = os.environ.get("TEST_SHIFTED_KERNELS", "")
    if choice not in ("", *SHIFTED_WORKERS):
        raise ValueError(f"TEST_SHIFTED_KERNELS={choice!r}: use '', 'all' or 'half'")
    worker = SHIFTED_WORKERS.get(choice, "")
    if choice and worker in (None, os.environ.get("PYTEST_XDIST_WORKER")):
        for name, value in SHIFTED_KERNELS.items():
            os.environ.setdefault(name, value)


def pytest_configure(config) -> None:
    _shift_kernels()
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_report_header(config) -> str:
    import torch

    chosen = ", ".join(f"{name}={os.environ[name]}" for name in SHIFTED_KERNELS if name in os.environ)
    shifted = os.environ.get("TEST_SHIFTED_KERNELS")
    where = f"; TEST_SHIFTED_KERNELS={shifted}" if shifted else ""
    return f"cpu kernels: {torch.backends.cpu.get_cpu_capability()} ({chosen or 'the CPU default'}{where})"
