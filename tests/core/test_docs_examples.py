"""Every ```python block of README.md and docs/*.md runs (on CPU; blocks after `<!-- gpu -->` only with CUDA).

A file's blocks run in order in one namespace, as one session: a later block may use what an
earlier one defined. A block marked `<!-- gpu -->` (on the line before its fence) needs CUDA and is
skipped without it; no CPU block may depend on a GPU block.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?P<mark><!--\s*gpu\s*-->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```", re.M | re.S)
SLOW_PAGES = {"transformers.md"}  # imports transformers and builds a model


def blocks(page: Path):
    """[(line number, needs_gpu, code)] of the page's python blocks."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, bool(m.group("mark")), m.group("code"))
            for m in BLOCK.finditer(text)]


def test_every_page_is_found_and_has_linked_docs():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
    assert blocks(ROOT / "README.md"), "README.md has no python example"


@pytest.mark.parametrize("page", [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW_PAGES else [])
                                  for p in PAGES])
def test_examples_run(page, capsys):
    found = blocks(page)
    if not found:
        pytest.skip(f"{page.name} has no python example")
    if page.name in SLOW_PAGES:
        pytest.importorskip("transformers")
    namespace = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for line, needs_gpu, code in found:
        if needs_gpu and not torch.cuda.is_available():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a FallbackWarning is part of some examples' story
            try:
                exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{page.name}, the block at line {line} failed: {type(exc).__name__}: {exc}") from exc
        ran += 1
    assert ran, f"{page.name}: every example needs a GPU"
