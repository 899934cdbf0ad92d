"""Context parallelism on 4 gloo processes: CP groups that are not the world group (two groups of
2: consecutive ranks, strided ranks, a DeviceMesh dim), the ring's exchange posted before and
waited after each block's attention, and a rank that raises mid-step making every rank raise
(no hang) for each strategy."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cp_group_cases as C  # noqa: E402
from _spawn import merge_cases, run_group  # noqa: E402

pytestmark = [pytest.mark.slow,  # spawned gloo process groups
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

WORLD = 4
PG_TIMEOUT_S = 4.0
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not _RESULTS:
        _RESULTS.update(merge_cases(run_group(WORLD, C.worker, (), str(tmp_path_factory.mktemp("groups")))))
    return _RESULTS


@pytest.mark.parametrize("case", list(C.cases(WORLD)))
def test_groups_and_ring_order(results, case):
    assert "<startup>" not in results, results["<startup>"][1]
    assert case in results, f"case {case} did not run"
    ok, msg = results[case]
    assert ok, msg


@pytest.fixture(scope="module")
def fault_results(tmp_path_factory):
    return run_group(WORLD, C.fault_worker, (PG_TIMEOUT_S,), str(tmp_path_factory.mktemp("faults")),
                     deadline_s=60 + 10 * PG_TIMEOUT_S * len(C.COMMS))


@pytest.mark.parametrize("comm", C.COMMS)
def test_a_failing_rank_makes_every_rank_raise(fault_results, comm):
    """Rank 2 raises inside its attention (forward); ranks 0, 1, 3 are left waiting in an exchange
    and must raise once the CP group's timeout expires, well before the test's deadline (a hang
    fails it: run_group kills the processes and raises TimeoutError)."""
    assert all(fault_results[r] is not None for r in range(WORLD)), f"a rank reported nothing: {fault_results}"
    res = {r: fault_results[r][comm] for r in range(WORLD)}
    failing = res[2]
    assert failing["raised"] and C.FAULT in failing["message"], failing
    assert any("rank 2 of 4 failed in the forward" in n and repr(comm) in n for n in failing["notes"]), failing
    for r in (0, 1, 3):
        assert res[r]["raised"], f"rank {r} did not raise: {res[r]}"
        assert C.FAULT not in res[r]["message"], res[r]
        assert res[r]["elapsed_s"] < 5 * PG_TIMEOUT_S, res[r]
