#!/usr/bin/env bash
# GPU checks in one prepared script: ring attention's CUDA block kernels (flash, efficient) against SDPA, MFU of a
# ~0.9B model on one GPU, scaling over the GPUs present, and the overhead comparison when there are at least
# 4 GPUs. Prints the same tables as on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
gpus=$($PY -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 1 ] || { echo "no CUDA device: nothing to check" >&2; exit 1; }
$PY benchmarks/attention_kernels.py --device cuda
$PY benchmarks/mfu.py
$PY benchmarks/scaling.py --accelerator cuda --max-ranks "$gpus"
if [ "$gpus" -ge 4 ]; then $PY benchmarks/overhead.py --accelerator=cuda; fi
