#!/usr/bin/env bash
# Run the GPU test suite and the benchmark suite on a CUDA machine; logs and tables go to $1.
# Usage: bash benchmarks/gpu_suite.sh OUTDIR [quick|full]
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR [quick|full]}
mode=${2:-quick}
mkdir -p "$out"
python3 -c "import torch, cudnn; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', cudnn.backend_version_string(), 'frontend', cudnn.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE 2>&1 | tee "$out/gpu_tests.log" | tail -40
rc=${PIPESTATUS[0]}
if [ "$mode" = quick ]; then flag=--quick; else flag=; fi
python3 -m fused_attn bench all $flag --out "$out" 2>&1 | tee "$out/bench.log" | tail -80
exit $rc
