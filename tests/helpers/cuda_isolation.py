"""pytest plugin for GPU runs: a test that leaves the CUDA context broken (an illegal address,
a launch failure: every later CUDA call in the process fails) ends its process once its report
is written, so a pytest-xdist worker restarts clean and the failure stays with the test that
caused it instead of spreading to every test after it.

Use: `pytest -p helpers.cuda_isolation -n 8 -m gpu tests` (tests/ on the path, as benchmarks/gpu_suite.sh
runs it).
"""

from __future__ import annotations

import os

_STICKY = ("illegal memory access", "illegal address", "unspecified launch failure",
           "CUDA_DRIVER", "misaligned address", "an illegal instruction",
           # a device-side assert (our asynchronous cu_seqlens checks, torch's) is sticky too
           "device-side assert", "cudaErrorAssert")


def _sticky(report) -> bool:
    text = str(getattr(report, "longrepr", "") or "")
    return report.failed and any(s in text for s in _STICKY)


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and _sticky(report) and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)  # xdist reports the test as crashed and starts a fresh worker
