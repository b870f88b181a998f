#!/usr/bin/env bash
# The front door.   bash torchrun.sh [train.py flags]
#   With GPUs: the qwen3-8b-1m recipe on every GPU of this node (override anything, e.g. --model DIR).
#   Without:   the CPU demo on 2 processes.
#   Several nodes: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT as torchrun knows them, e.g. one
#   row over two nodes of 8 (sp across both), the same line on each with its own NODE_RANK:
#     NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash torchrun.sh --sp 16
#   SLURM, one task per node (node 0 is the first host of the allocation):
#     srun --nodes 2 --ntasks-per-node 1 bash -c 'NNODES=$SLURM_NNODES NODE_RANK=$SLURM_NODEID \
#       MASTER_ADDR=$(scontrol show hostnames $SLURM_NODELIST | head -1) bash torchrun.sh --sp 16'
#   Stopping for later: SIGTERM or SIGUSR1 to this script; the step finishes, a checkpoint is
#   written, exit 0; the same command with --resume auto continues.
set -euo pipefail
cd "$(dirname "$0")"
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
args=("${preset[@]}" "$@")

# Every check once, in one process, before N start: a bad flag, config or token file costs a
# second and prints one line (exit 2), not one traceback per rank. Node 0 also checks --out.
RANK=$(( ${NODE_RANK:-0} * nproc )) WORLD_SIZE=$(( nproc * ${NNODES:-1} )) LOCAL_WORLD_SIZE=$nproc \
  python3 train.py --check-only "${args[@]}" || exit $?

# Several NUMA nodes (two-socket GPU servers): each process runs on the CPUs of its GPU's node,
# so the ~72 GiB of host blocks it pins land in that node's memory (Linux places a page where it
# is first touched), next to the PCIe link its copies take. torchrun's own --numa-binding.
numa=()
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
if [ "$gpus" -gt 0 ] && [ "$nodes" -gt 1 ]; then
  numa=(--numa-binding node)
fi

python3 -m torch.distributed.run "${numa[@]}" \
  --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$nproc" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  train.py "${args[@]}" &
pid=$!
# Preemption: schedulers send SIGTERM or SIGUSR1 (e.g. sbatch --signal=B:USR1@300) to this script.
# torchrun would pass SIGTERM on and kill the workers 30 s later, mid-step; instead the signal goes
# straight to the workers (torchrun's children), which finish the step, save a checkpoint and exit 0.
forward() { pkill "-$1" -P "$pid" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
while true; do
  wait "$pid" && rc=0 || rc=$?
  kill -0 "$pid" 2>/dev/null || break  # wait also returns when a trapped signal arrives
done
exit "$rc"
