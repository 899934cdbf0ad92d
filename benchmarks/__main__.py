"""`python -m benchmarks [suite] [--quick] [--out DIR]` from a source checkout: the benchmark suites."""

import sys

from benchmarks import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
