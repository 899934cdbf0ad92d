"""Run the fused_attn 'dense' benchmark suite: python benchmarks/bench_dense.py [--quick] [--out DIR].

Same as `python -m fused_attn bench dense ...`; see benchmarks/README.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fused_attn.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["dense", *sys.argv[1:]]))
