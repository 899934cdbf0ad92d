"""Every cuDNN quirk entry against the cuDNN this process loaded: its probe
(tests/helpers/quirk_probes.py) runs the plain path in a process of its own and must show the fault
exactly where the entry says it applies, and be exact right outside it. A cuDNN upgrade that fixes or breaks something fails
here, naming the entry to change."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.quirk_probes import PROBES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(TESTS)
PROBE = os.path.join(TESTS, "helpers", "quirk_probes.py")


def _verdict(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, PROBE, name], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")]
    if lines:
        return lines[-1][len("VERDICT "):]
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return f"crash: rc {proc.returncode}: {tail[:300]}"


def test_every_entry_has_a_probe():
    from fused_attn.backends.cudnn import quirks

    assert set(PROBES) == set(quirks.QUIRKS)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_quirk_matches_this_cudnn(name):
    from fused_attn.backends.cudnn import quirks, version

    ver = version.backend_version()
    applies = quirks.QUIRKS[name].applies(ver)
    verdict = _verdict(name)
    shown = "faulty" if verdict != "ok" else "right"
    said = "faulty" if applies else "right"
    assert shown == said, (f"quirk {name!r}: the entry says cuDNN {quirks.version_string(ver)} is {said} "
                           f"({quirks.QUIRKS[name].versions()}), its plain path says {shown}: {verdict}")
