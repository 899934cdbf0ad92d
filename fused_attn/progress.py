"""Optional progress bars for long runs (self-check, benchmarks, graph warm-up).

`tqdm` is used when it is installed and stdout is a terminal; otherwise the iterable comes back
unchanged, so logs and pipes stay free of bar noise and tqdm is never a dependency.
"""

from __future__ import annotations

import sys
from typing import Iterable, Optional, TypeVar

T = TypeVar("T")


def progress(iterable: Iterable[T], desc: str, total: Optional[int] = None) -> Iterable[T]:
    """`tqdm(iterable)` on a terminal when tqdm is importable, else `iterable` itself."""
    isatty = getattr(sys.stdout, "isatty", None)
    if not (callable(isatty) and isatty()):
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr)
