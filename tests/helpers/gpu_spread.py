"""pytest plugin for GPU runs on a machine with several GPUs: each pytest-xdist worker sees one
of them (worker i takes the i-th mod N of the visible GPUs), so the workers of one run share
every GPU instead of crowding the first.

Use: `pytest -p helpers.gpu_spread --gpus 4 -n 32 -m gpu tests` (tests/ on the path, as
benchmarks/gpu_suite.sh runs it on a machine with two or more GPUs). It sets CUDA_VISIBLE_DEVICES
in each worker before any test module is imported, so before CUDA starts there.
"""

from __future__ import annotations

import os


def pytest_addoption(parser) -> None:
    parser.addoption("--gpus", type=int, default=1,
                     help="spread pytest-xdist workers over this many GPUs (one GPU per worker)")


def pytest_configure(config) -> None:
    count = config.getoption("--gpus")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if count < 2 or not worker.startswith("gw"):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(worker[2:]) % min(count, len(ids))]
