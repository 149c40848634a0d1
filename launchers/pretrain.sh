#!/usr/bin/env bash
# Per-rank entry of a pretrieve pre-training run:
#   launchers/pretrain.sh CONFIG [key=value ...]                         one process, no launcher
#   deepspeed [--hostfile H] --no_python launchers/pretrain.sh CONFIG ... one process per device
#   torchrun --nproc_per_node N --no-python launchers/pretrain.sh CONFIG ...
#   srun launchers/pretrain.sh CONFIG ...                                 one SLURM task per rank
# It maps the rank variables of whichever launcher started it onto RANK / LOCAL_RANK / WORLD_SIZE /
# MASTER_ADDR / MASTER_PORT, sets thread counts, and execs `python -m pretrieve pretrain`. Exit codes are the
# engine's: 0 done, 85 preempted with a checkpoint saved (requeue; resume=auto continues), others are errors.
# Environment: PRETRIEVE_PYTHON (default: python), OMP_NUM_THREADS (default: cores / ranks on this node).
set -euo pipefail

# The deepspeed launcher passes --local_rank=N first unless it is given --no_local_rank.
if [[ ${1:-} == --local_rank=* ]]; then
  export LOCAL_RANK=${1#--local_rank=}
  shift
fi
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  echo "usage: launchers/pretrain.sh CONFIG [key=value ...]   (see launchers/README.md)" >&2
  exit 2
fi

# deepspeed and torchrun set RANK; under srun each task is a rank and SLURM numbers them.
if [[ -z ${RANK:-} && -n ${SLURM_PROCID:-} ]]; then
  export RANK=$SLURM_PROCID LOCAL_RANK=${SLURM_LOCALID:-0} WORLD_SIZE=${SLURM_NTASKS:-1}
  tasks_per_node=${SLURM_TASKS_PER_NODE:-1}  # "4(x2)" or "4,2": the first count
  export LOCAL_SIZE=${SLURM_NTASKS_PER_NODE:-${tasks_per_node%%[(,]*}}
  if [[ -z ${MASTER_ADDR:-} && -n ${SLURM_JOB_NODELIST:-} ]]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # reads all: no SIGPIPE under pipefail
    export MASTER_ADDR
  fi
  export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
fi
export RANK=${RANK:-0} LOCAL_RANK=${LOCAL_RANK:-0} WORLD_SIZE=${WORLD_SIZE:-1}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}

# Ranks on one node share its cores; more threads than cores makes CPU ranks (and ZeRO-3) many times slower.
ranks_here=${LOCAL_WORLD_SIZE:-${LOCAL_SIZE:-1}}
threads=$(( $(nproc) / (ranks_here > 0 ? ranks_here : 1) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-$OMP_NUM_THREADS}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}  # DataLoader workers fork after tokenizing
export PYTHONUNBUFFERED=1  # rank logs arrive in order with the launcher's

exec "${PRETRIEVE_PYTHON:-python}" -m pretrieve pretrain "$@"
