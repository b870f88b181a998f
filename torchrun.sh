#!/usr/bin/env bash
# The front door.   bash torchrun.sh [train.py flags]
#   With GPUs: the qwen3-8b-1m recipe on every GPU of this node (override anything, e.g. --model DIR).
#   Without:   the CPU demo on 2 processes.
#   Several nodes: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT as torchrun knows them.
set -euo pipefail
cd "$(dirname "$0")"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # 1 GB+ tensors, no fragmentation
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -gt 0 ]; then
  nproc=${NPROC_PER_NODE:-$gpus}
  preset=(--preset qwen3-8b-1m)
else
  echo "torchrun.sh: no CUDA GPU here; running the CPU demo on 2 processes (gloo)." >&2
  nproc=${NPROC_PER_NODE:-2}
  preset=(--preset demo)
fi
# A preset given on the command line wins over the default one.
for a in "$@"; do [ "$a" = "--preset" ] && preset=(); done
exec python3 -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$nproc" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  train.py "${preset[@]}" "$@"
