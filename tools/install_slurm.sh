#!/usr/bin/env bash
# Installs what `make test-cluster` needs from Debian when it is missing: SLURM (slurmctld, slurmd, the client
# commands) and munge. Root only; the packages' own services are not started (the tests start their own daemons
# with a configuration under a temporary directory). Without root or apt it says so and leaves the tests to skip.
set -euo pipefail

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install_slurm.sh: SLURM is not installed and this is not a root Debian machine; the cluster tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d: the packages' post-install scripts must not start the system's own slurm or munge services
policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=1
fi
trap '[[ $own_policy -eq 0 ]] || rm -f "$policy"' EXIT
apt-get update -q
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
