"""Run the fused_attn 'all' benchmark suite: python benchmarks/bench_all.py [--quick] [--out DIR].

Same as `python -m fused_attn bench all ...`; see benchmarks/README.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fused_attn.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["all", *sys.argv[1:]]))
