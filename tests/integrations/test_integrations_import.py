"""The integrations package loads its submodules on first access, in every import form."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~10-30 s each
@pytest.mark.parametrize("code", [
    "from fused_attn.integrations import transformers as m",
    "import fused_attn.integrations as pkg; m = pkg.transformers",
    "import fused_attn.integrations.transformers as m",
])
def test_transformers_integration_imports_in_a_fresh_process(code):
    # a fresh interpreter: in this one the submodule may already be loaded by other tests
    done = subprocess.run([sys.executable, "-c", code + "; print(m.__name__, callable(m.register))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["fused_attn.integrations.transformers", "True"]


def test_unknown_integration_is_an_attribute_error():
    import fused_attn.integrations as pkg

    with pytest.raises(AttributeError, match="no attribute 'deepspeed'"):
        pkg.deepspeed  # noqa: B018
