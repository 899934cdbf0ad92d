#!/usr/bin/env bash
# The GPU half of the checks on a CUDA machine: the gpu-marked tests (spread over the GPUs, and the
# distributed ones, when two or more are present), then the benchmarks; logs, tables and CSVs go to OUTDIR/cudnn-<version>.
# Usage: bash benchmarks/gpu_suite.sh OUTDIR [quick|full] [all|tests|bench] [CUDNN]
#   CUDNN: the cuDNN this run is meant for, e.g. 9.19 (torch 2.11's pin) or 9.27 (install it with
#   `pip install 'nvidia-cudnn-cu13==9.27.*'` in place of torch's copy); the run stops when the loaded
#   library is another one. "any" (default) takes whatever loads.
# A test that breaks the CUDA context (an illegal address) ends its pytest-xdist worker
# (tests/helpers/cuda_isolation.py), so the failure stays with that test.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR [quick|full] [all|tests|bench] [CUDNN]}
mode=${2:-quick}
what=${3:-all}
want=${4:-any}
loaded=$(python3 -c "import cudnn; v = cudnn.backend_version(); print(f'{v // 10000}.{v // 100 % 100}')") || exit 1
if [ "$want" != any ] && [ "$want" != "$loaded" ]; then
    echo "gpu_suite.sh: asked for cuDNN $want, but cuDNN $loaded is loaded" >&2; exit 2
fi
out="$out/cudnn-$loaded"
mkdir -p "$out"
python3 -c "import torch, cudnn; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', cudnn.backend_version_string(), 'frontend', cudnn.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())" | tee "$out/versions.txt"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
rc=0
if [ "$what" != bench ]; then
    extra=()
    # pytest-xdist workers: half the host cores plus 4, at most 12 per GPU (graph building is
    # host-bound); with several GPUs each worker takes one (tests/helpers/gpu_spread.py)
    workers=$(( $(nproc) / 2 + 4 )); cap=$(( 12 * (ngpu > 0 ? ngpu : 1) )); [ "$workers" -gt "$cap" ] && workers=$cap
    threads=1
    if python3 -c "import xdist" 2>/dev/null; then
        # each worker's CPU math (the float64 references) on its share of the cores instead of
        # torch's default of a thread per core in every worker: with 36 workers on a 64-core host
        # a test that runs alone in 33 s took 327 s, past the 300 s timeout
        threads=$(( $(nproc) / workers )); [ "$threads" -lt 1 ] && threads=1
        extra+=(-p xdist -n "$workers" -p helpers.cuda_isolation)
        if [ "$ngpu" -ge 2 ]; then extra+=(-p helpers.gpu_spread --gpus "$ngpu"); fi
    fi
    if python3 -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout 300); fi
    OMP_NUM_THREADS=$threads PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/tests" python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfEx --durations 25 \
        "${extra[@]}" --ignore tests/distributed/test_distributed_gpu.py > "$out/gpu_tests.log" 2>&1 || rc=1
    tail -45 "$out/gpu_tests.log"
    if [ "$ngpu" -ge 2 ]; then
        python3 -m pytest -q -m gpu tests/distributed/test_distributed_gpu.py -p no:cacheprovider -rfE \
            > "$out/gpu_distributed_tests.log" 2>&1 || rc=1
        tail -15 "$out/gpu_distributed_tests.log"
    fi
fi
if [ "$what" != tests ]; then
    if [ "$mode" = quick ]; then flag=--quick; else flag=; fi
    for suite in host varlen mods dense models; do
        python3 -m fused_attn bench "$suite" $flag --out "$out" > "$out/bench_$suite.log" 2>&1 || rc=1
        tail -60 "$out/bench_$suite.log"
    done
    if [ "$ngpu" -ge 2 ]; then
        python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_cp.py $flag --out "$out" > "$out/bench_cp.log" 2>&1 || rc=1
        tail -30 "$out/bench_cp.log"
    fi
fi
exit $rc
