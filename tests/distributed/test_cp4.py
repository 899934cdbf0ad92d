"""Context parallelism on 4 processes (gloo, CPU): ring, all-gather and head-parallel all-to-all,
dense and packed (thd), masks and score_mods that read positions, forward and every gradient,
each held in float32 to the project's rule against float64 (see _cp_compare). One group of 4
processes runs every case once (tests look their case up)."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cp4_cases  # noqa: E402
from _spawn import merge_cases, run_group  # noqa: E402

pytestmark = [pytest.mark.slow,  # spawned gloo process groups
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

WORLD = 4
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not _RESULTS:
        _RESULTS.update(merge_cases(run_group(WORLD, _cp4_cases.worker, (".",), str(tmp_path_factory.mktemp("cp4")))))
    return _RESULTS


@pytest.mark.parametrize("case", list(_cp4_cases.cases(WORLD)))
def test_context_parallel_4_ranks(results, case):
    assert "<startup>" not in results, results["<startup>"][1]
    assert case in results, f"case {case} did not run"
    ok, msg = results[case]
    assert ok, msg
