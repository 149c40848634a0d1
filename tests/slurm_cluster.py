"""A real SLURM cluster on this host for the tests: munged, slurmctld and two slurmd (`-N ptnode1`, `-N ptnode2`),
each node an address of its own on loopback (127.0.0.21-22, added to /etc/hosts while the cluster runs). Its
configuration, state, spool and logs live under a temporary directory; `stop()` ends the daemons it started and
puts /etc/hosts back. Needs root and Debian's slurmctld, slurmd, slurm-client and munge (tools/install_slurm.sh).

A requeued job may start again after cred_expire (10 s here; SLURM's default is 120 s): the nodes refuse the
job's revoked credential until then.

Partitions, on both nodes: `cpu` (default; preemptible, PreemptMode=REQUEUE) and `urgent` (a higher priority
tier: its jobs preempt `cpu` jobs)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

NODES = {"ptnode1": "127.0.0.21", "ptnode2": "127.0.0.22"}
HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# pretrieve test cluster"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun")


def missing() -> str | None:
    """Why this host cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the SLURM cluster tests need root (daemons, /etc/hosts)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if absent:
        return f"SLURM / munge not installed ({', '.join(absent)}); tools/install_slurm.sh installs them"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Cluster:
    def __init__(self, root: Path, ports: list[int]):
        self.root = root
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._ports = ports
        self._daemons: list[subprocess.Popen] = []

    # --- life ---------------------------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        try:
            self._add_hosts()
            self._start_munge()
            self._write_conf()
            ctl = self.root / "slurmctld.log"
            self._spawn([_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)], ctl.with_suffix(".out"))
            for node in NODES:
                self._spawn([_daemon("slurmd"), "-D", "-N", node, "-f", str(self.conf)],
                            self.root / f"slurmd-{node}.out")
            self._wait_idle(timeout=90)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        self._kill_leftover_steps()
        self._remove_hosts()

    def _spawn(self, argv: list[str], log: Path) -> None:
        out = open(log, "ab")
        self._daemons.append(subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        out.close()

    def _kill_leftover_steps(self) -> None:
        """slurmstepd processes of this cluster's jobs (they outlive slurmd): found by our SLURM_CONF."""
        ours = f"SLURM_CONF={self.conf}"
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                if "slurmstepd" in cmdline and ours in (proc / "environ").read_bytes().decode(errors="replace"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    # --- munge ----------------------------------------------------------------------------------------------------
    def _start_munge(self) -> None:
        home = self.root / "munge"
        home.mkdir(mode=0o700)
        key = home / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn([_daemon("munged"), "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                     f"--pid-file={home / 'munged.pid'}", f"--log-file={home / 'munged.log'}",
                     f"--seed-file={home / 'munged.seed'}"], home / "munged.out")
        deadline = time.time() + 30
        while not self.socket.exists():
            if time.time() > deadline or self._daemons[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {(home / 'munged.out').read_text()[-2000:]}")
            time.sleep(0.1)

    # --- configuration --------------------------------------------------------------------------------------------
    def _write_conf(self) -> None:
        for folder in ("state", *(f"spool/{node}" for node in NODES)):
            (self.root / folder).mkdir(parents=True)
        ctl_port, *node_ports = self._ports
        nodes = "\n".join(f"NodeName={name} NodeAddr={addr} Port={port} CPUs=2 State=UNKNOWN"
                          for (name, addr), port in zip(NODES.items(), node_ports))
        r = self.root
        self.conf.write_text(f"""\
ClusterName=pretrieve-test
SlurmctldHost={os.uname().nodename}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=2
MinJobAge=3600
KillWait=30
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=cpu Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=urgent Nodes={','.join(NODES)} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")

    def _add_hosts(self) -> None:
        self._remove_hosts()  # a run that was killed before it could clean up
        text = HOSTS.read_text()
        lines = [f"{addr} {name} {HOSTS_MARK}" for name, addr in NODES.items()]
        HOSTS.write_text(text + ("" if text.endswith("\n") else "\n") + "\n".join(lines) + "\n")

    def _remove_hosts(self) -> None:
        kept = [line for line in HOSTS.read_text().splitlines(keepends=True) if HOSTS_MARK not in line]
        HOSTS.write_text("".join(kept))

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            if set(states[::2]) == set(NODES) and set(states[1::2]) == {"idle"}:  # a row per node and partition
                return
            if any(d.poll() is not None for d in self._daemons):
                break
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster's nodes did not come up: {self.logs()}")

    # --- use ------------------------------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=60, **kwargs)

    def submit(self, *argv: str, cwd: Path, env: dict) -> int:
        done = self.run("sbatch", "--parsable", *argv, cwd=cwd, env={**env, "SLURM_CONF": str(self.conf)},
                        check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def jobs(self, job_id: int) -> list[dict]:
        """`scontrol show job` as dicts (JobState, Restarts, ExitCode, ...): one, or one per array task."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def job(self, job_id: int) -> dict:
        return self.jobs(job_id)[0]

    def wait(self, job_id: int, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), timeout: float = 600) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s")

    def logs(self) -> str:
        """The daemons' logs' tails, for a failing assertion's message."""
        parts = []
        for log in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)
