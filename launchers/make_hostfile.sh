#!/usr/bin/env bash
# SLURM nodelist -> DeepSpeed hostfile ("host slots=N" per node), for `deepspeed --hostfile`:
#   launchers/make_hostfile.sh [NODELIST] [SLOTS] > hostfile
# NODELIST defaults to $SLURM_JOB_NODELIST (e.g. "gpu[01-04],cpu7"); SLOTS, the ranks per node, to
# $SLURM_GPUS_ON_NODE, then $SLURM_NTASKS_PER_NODE, then 1.
set -euo pipefail

nodelist=${1:-${SLURM_JOB_NODELIST:-}}
slots=${2:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}
if [[ -z $nodelist ]]; then
  echo "usage: make_hostfile.sh [NODELIST] [SLOTS]  (no NODELIST given and SLURM_JOB_NODELIST is not set)" >&2
  exit 2
fi
if ! [[ $slots =~ ^[1-9][0-9]*$ ]]; then
  echo "make_hostfile.sh: SLOTS must be a positive integer, got '$slots'" >&2
  exit 2
fi
scontrol show hostnames "$nodelist" | while read -r host; do
  [[ -n $host ]] && echo "$host slots=$slots"
done
