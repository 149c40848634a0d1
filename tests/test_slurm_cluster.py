"""The SLURM launchers on a real cluster (tests/slurm_cluster.py: slurmctld and two slurmd on this host): a fresh
checkout's first job; USR1 before the time limit -> checkpoint -> exit 85 -> requeue -> resume with every loss
equal to an uninterrupted run's, on one node and on two; USR1 while DeepSpeed compiles its op at start-up; SLURM's
own preemption (PreemptMode=REQUEUE); the evaluation farm's array with a failing task; a follower job beside a
training job (`farm --follow`); a GPU request on a CPU cluster. Root only (`make test-cluster`)."""

import contextlib
import json
import os
import re
import socket
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from support import free_port, pretrain_env, signal_in_mask
from slurm_cluster import Cluster, missing
from test_launchers import _losses, _weights

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), [int(free_port()) for _ in range(3)]).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The repository as a fresh clone has it: tracked and new files, no logs/ or runs/ folder."""
    out = tmp_path_factory.mktemp("checkout") / "pretrieve"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, out / name)
    return out


def _env(**extra) -> dict:
    """What sbatch exports to the job: DeepSpeed on CPU, one thread a rank, this interpreter for the ranks."""
    env = {k: v for k, v in pretrain_env().items() if not k.startswith("SLURM_")}
    return {**env, "PRETRIEVE_PYTHON": sys.executable, **extra}


def _args(wiki_shards: Path, *extra: str) -> list[str]:
    return ["configs/pretrain/tiny-mlm.yaml", f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
            "method.max_len=64", f"train.max_steps={STEPS}", "train.micro_batch_size=4", "train.log_every=1",
            "train.zero_stage=2", "checkpoint.every=20", "data.num_workers=1", *extra]


def _pretrain(cluster, checkout, wiki_shards, run_dir: Path, *sbatch: str, extra=(), **env) -> int:
    return cluster.submit(*sbatch, "launchers/slurm/pretrain.sbatch", *_args(wiki_shards, *extra), cwd=checkout,
                          env=_env(RUN_DIR=str(run_dir), **env))


def _wait_for_steps(run_dir: Path, job: int, cluster, steps: int = 1, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert time.time() < deadline, f"job {job}: no training step in {timeout} s: {cluster.job(job)}"
        time.sleep(0.05)


def _ranks(run_dir: Path) -> list[psutil.Process]:
    """The job's training processes (the SLURM tasks, found by their run_dir argument; not their DataLoader
    workers, forked with the same command line)."""
    argument = f"run_dir={run_dir}"
    found = [p for p in psutil.process_iter(["cmdline", "ppid"]) if argument in (p.info["cmdline"] or [])
             and "pretrieve" in p.info["cmdline"]]
    return [p for p in found if p.info["ppid"] not in {q.pid for q in found}]


def _signal_paused(cluster, job: int, run_dir: Path, signal_job) -> None:
    """Pause the ranks, signal the job (`signal_job()`), and let the ranks go on once the signal waits for each:
    the run cannot finish first, however slow SLURM is to deliver. (SLURM's own preemption sends SIGCONT itself.)"""
    def signalled(rank: psutil.Process) -> bool:  # a pending stop signal, or already going on / gone
        if not rank.is_running() or rank.status() != psutil.STATUS_STOPPED:
            return True
        return any(signal_in_mask(rank.pid, sig, "ShdPnd", "SigPnd") for sig in (signal.SIGUSR1, signal.SIGTERM))

    ranks = _ranks(run_dir)
    assert ranks, f"job {job}: no training process found"
    for rank in ranks:
        rank.suspend()
    try:
        signal_job()
        deadline = time.time() + 60
        while not all(signalled(rank) for rank in ranks):
            assert time.time() < deadline, f"job {job}: the signal did not reach the ranks: {cluster.job(job)}"
            time.sleep(0.05)
    finally:
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.resume()


def _finished(cluster, job: int, checkout: Path, restarts: int) -> str:
    """Wait for `job` to complete after `restarts` requeues; its batch log (both attempts). No attempt left a
    DeepSpeed CPU all-reduce buffer in /dev/shm (they are named after the job's master port)."""
    state = cluster.wait(job)
    log = (checkout / f"pretrieve-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"{state}\n{log[-3000:]}"
    assert state["Restarts"] == str(restarts), f"{state}\n{log[-3000:]}"
    for port in _master_ports(log):
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), port
    return log


def _master_ports(log: str) -> list[int]:
    """The master port of each attempt, as the batch log's first line of the attempt says it."""
    return [int(port) for port in re.findall(r"master \S+?:(\d+),", log)]


@pytest.fixture(scope="module")
def one_node(cluster, checkout, wiki_shards, tmp_path_factory) -> Path:
    """A fresh checkout's first job (the batch log goes to the submit directory, which has no logs/ folder):
    one node, one rank, uninterrupted. The reference of the one-node tests."""
    assert not (checkout / "logs").exists()
    run_dir = tmp_path_factory.mktemp("one-node") / "run"
    job = _pretrain(cluster, checkout, wiki_shards, run_dir, extra=["tracking.enabled=false"])
    log = _finished(cluster, job, checkout, restarts=0)
    assert f"job {job} attempt 1: 1 node(s), 1 ranks" in log
    assert [step for step, _ in _losses(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert _ranks_log(checkout, job)  # made by the job
    return run_dir


def _ranks_log(checkout: Path, job: int) -> str:
    """The ranks' output: logs/%x-%j-%N.log, %N the host's name (one for both nodes here)."""
    return "".join(log.read_text() for log in sorted((checkout / "logs").glob(f"pretrieve-{job}-*.log")))


def test_a_fresh_checkouts_first_job_trains(one_node):
    assert (one_node / "checkpoints" / "latest").read_text() == f"step{STEPS:08d}"


def test_usr1_before_the_time_limit_requeues_and_resumes_exactly(cluster, checkout, wiki_shards, one_node, tmp_path):
    """As `#SBATCH --signal=USR1@600` does: USR1 to every process of the job's steps (not the batch script)."""
    from mlflow.tracking import MlflowClient

    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = _pretrain(cluster, checkout, wiki_shards, run_dir, extra=[f"tracking.uri={uri}"])
    _wait_for_steps(run_dir, job, cluster)
    _signal_paused(cluster, job, run_dir, lambda: cluster.run("scancel", "--signal=USR1", str(job)))
    log = _finished(cluster, job, checkout, restarts=1)
    assert "preempted with a checkpoint" in log and f"job {job} attempt 2" in log
    assert _losses(run_dir) == _losses(one_node)  # every step once, as uninterrupted
    ours, reference = _weights(run_dir), _weights(one_node)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", "the requeued attempt continues the MLflow run"
    assert runs[0].data.tags["slurm_job_id"] == str(job)
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == list(range(1, STEPS + 1))


def test_two_nodes_preempted_by_usr1_resume_exactly(cluster, checkout, wiki_shards, tmp_path):
    """One rank on each node (the documented CPU-cluster shape): an uninterrupted job, and one that USR1 stops."""
    nodes = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1"]
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    first = _pretrain(cluster, checkout, wiki_shards, reference, *nodes, extra=["tracking.enabled=false"])
    log = _finished(cluster, first, checkout, restarts=0)
    assert "2 node(s), 2 ranks" in log
    job = _pretrain(cluster, checkout, wiki_shards, run_dir, *nodes, extra=["tracking.enabled=false"])
    _wait_for_steps(run_dir, job, cluster)
    _signal_paused(cluster, job, run_dir, lambda: cluster.run("scancel", "--signal=USR1", str(job)))
    _finished(cluster, job, checkout, restarts=1)
    assert _losses(run_dir) == _losses(reference)
    assert _ranks_log(checkout, job).count("preempted: saved step ") == 2  # both ranks


def test_usr1_while_deepspeed_compiles_at_start_up(cluster, checkout, wiki_shards, one_node, tmp_path):
    """An empty extension cache: the job's first attempt JIT-compiles DeepSpeed's op. USR1 to every process of
    the step while the compiler runs: the compile finishes, the rank exits 85 before its first step, the job is
    requeued and trains as the uninterrupted run."""
    run_dir, extensions = tmp_path / "run", tmp_path / "torch_extensions"
    job = _pretrain(cluster, checkout, wiki_shards, run_dir, extra=["tracking.enabled=false"],
                    TORCH_EXTENSIONS_DIR=str(extensions))
    deadline = time.time() + 300
    while not _compiling(extensions):
        assert time.time() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), cluster.job(job)
        time.sleep(0.05)
    cluster.run("scancel", "--signal=USR1", str(job))
    log = _finished(cluster, job, checkout, restarts=1)
    ranks_log = _ranks_log(checkout, job)
    assert "preempted, during start-up, before the first step; exit 85" in ranks_log, ranks_log[-3000:]
    assert "preempted with a checkpoint" in log
    assert _losses(run_dir) == _losses(one_node)


def _compiling(extensions: Path) -> bool:
    """A compiler runs for the build into `extensions` (found by the environment it inherited)."""
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in ("cc1plus", "c++", "g++"):
            try:
                if proc.environ().get("TORCH_EXTENSIONS_DIR") == str(extensions):
                    return True
            except psutil.Error:
                continue
    return False


def test_preempt_mode_requeue_checkpoints_and_slurm_requeues(cluster, checkout, wiki_shards, one_node, tmp_path):
    """A job of the `urgent` partition (a higher tier) takes the node: SLURM signals the `cpu` job (SIGTERM to
    its steps and its batch script), the rank checkpoints and exits 85, and SLURM requeues the job itself; the
    job later resumes as the uninterrupted run."""
    run_dir = tmp_path / "run"
    job = _pretrain(cluster, checkout, wiki_shards, run_dir, "--nodelist=ptnode1", extra=["tracking.enabled=false"])
    _wait_for_steps(run_dir, job, cluster)
    urgent = []
    _signal_paused(cluster, job, run_dir, lambda: urgent.append(cluster.submit(
        "--partition=urgent", "--nodelist=ptnode1", "--cpus-per-task=2", "--wrap", "sleep 1", cwd=tmp_path,
        env=_env())))
    assert cluster.wait(urgent[0])["JobState"] == "COMPLETED"
    log = _finished(cluster, job, checkout, restarts=1)
    ranks_log = _ranks_log(checkout, job)
    assert "preempted: saved step " in ranks_log, log + ranks_log[:5000]
    assert _losses(run_dir) == _losses(one_node)


def test_a_start_up_failure_that_may_pass_is_requeued_a_bounded_number_of_times(cluster, checkout, tmp_path):
    """Exit 86 (engine/preemption.py: the rendezvous or the network failed at start-up): requeued START_RETRIES
    times in a row, then the job fails with that code."""
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\necho \"start-up attempt\"\nexit 86\n")
    python.chmod(0o755)
    job = cluster.submit("launchers/slurm/pretrain.sbatch", "configs/pretrain/tiny-mlm.yaml", cwd=checkout,
                         env=_env(PRETRIEVE_PYTHON=str(python), START_RETRIES="2", RUN_DIR=str(tmp_path / "run")))
    state = cluster.wait(job)
    log = (checkout / f"pretrieve-{job}.out").read_text()
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "86:0" and state["Restarts"] == "2", log
    assert "retry 1 of 2" in log and "retry 2 of 2" in log and "start-up failed 3 times in a row" in log
    assert _ranks_log(checkout, job).count("start-up attempt") == 3


def test_eval_farm_array_fails_only_the_failing_task(cluster, checkout, tmp_path):
    samples = ROOT / "pretrieve" / "assets" / "samples" / "wikipedia"
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"# one pretrieve command per line\n--version\n\nexport {tmp_path / 'missing'} {tmp_path / 'x'}\n"
                    f"prepare --source wikipedia --input {samples} --workers 0 --shard-size 1000 --out "
                    f"'{tmp_path / 'out a'}'\n")
    job = cluster.submit("--array=0-3", "launchers/slurm/eval_farm.sbatch", str(jobs), cwd=checkout, env=_env())
    deadline = time.time() + 300
    while True:
        tasks = {t["ArrayTaskId"]: t for t in cluster.jobs(job)}
        if len(tasks) == 4 and all(t["JobState"] in ("COMPLETED", "FAILED") for t in tasks.values()):
            break
        assert time.time() < deadline, tasks
        time.sleep(0.5)
    # the blank line and the comment are no jobs; a task past the 3 jobs fails, naming the list's size
    assert {i: t["JobState"] for i, t in tasks.items()} == {"0": "COMPLETED", "1": "FAILED", "2": "COMPLETED",
                                                           "3": "FAILED"}
    assert "pretrieve 0." in (checkout / f"pretrieve-eval-{job}_0.out").read_text()
    assert (tmp_path / "out a" / "manifest.json").is_file()  # the quoted path with a space
    failed = (checkout / f"pretrieve-eval-{job}_1.out").read_text()
    assert str(tmp_path / "missing") in failed
    assert "has 3 jobs, no job 3" in (checkout / f"pretrieve-eval-{job}_3.out").read_text()


def test_a_gpu_request_on_a_cpu_cluster_is_refused_at_once(cluster, checkout, wiki_shards, tmp_path):
    """The script asks for no GPUs itself; asking for one where there are none fails at submission, not later."""
    with pytest.raises(RuntimeError, match="sbatch failed") as refused:
        _pretrain(cluster, checkout, wiki_shards, tmp_path / "run", "--gpus-per-node=1")
    assert "Invalid generic resource (gres) specification" in str(refused.value), refused.value


def test_two_jobs_at_once_on_one_node_listen_on_two_free_ports(cluster, checkout, wiki_shards, tmp_path):
    """Two one-rank jobs submitted together to one node, where another program listens on the ports that
    `20000 + job id % 20000` gives them: each job's script chooses a port free on the node, and both train,
    leaving no buffer in /dev/shm. Ports are claimed until a job ends, so a job that starts beside another before
    its rank 0 listens cannot take its port: the second job may only use a port whose claim is stale (its script
    gone), and takes it; with the one port of its range claimed by a live process, a job fails at once, naming
    the range. A MASTER_PORT given that is taken fails the job at once, naming the port."""
    claims = tmp_path / "claims"
    claims.mkdir()
    ended = subprocess.Popen(["true"])
    ended.wait()
    only = int(free_port())
    (claims / f"{only}.{os.getuid()}").write_text(f"{ended.pid}\n")  # a stale claim: its script has ended
    probe = cluster.submit("--wrap", "true", cwd=tmp_path, env=_env())  # the job ids count on from here
    listeners = [_listen(20000 + (probe + i) % 20000) for i in (1, 2)]
    try:
        jobs = [_pretrain(cluster, checkout, wiki_shards, tmp_path / f"run{i}", "--nodelist=ptnode1",
                          "--cpus-per-task=1", extra=["tracking.enabled=false", "train.max_steps=2",
                                                      "checkpoint.every=2"], PORT_CLAIMS=str(claims),
                          **({"MASTER_PORT_RANGE": f"{only}-{only}"} if i == 2 else {})) for i in (1, 2)]
        assert jobs == [probe + 1, probe + 2]
        ports = [_master_ports(_finished(cluster, job, checkout, restarts=0)) for job in jobs]
        assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1], ports
        assert ports[1] == [only]
        assert not {port for [port] in ports} & {listener.getsockname()[1] for listener in listeners}
        assert sorted(p.name for p in claims.iterdir()) == [".lock"]  # each job took its claim away at its end

        (claims / f"{only}.{os.getuid()}").write_text(f"{os.getpid()}\n")  # claimed by a running process
        job = cluster.submit("launchers/slurm/pretrain.sbatch", "configs/pretrain/tiny-mlm.yaml", cwd=checkout,
                             env=_env(PORT_CLAIMS=str(claims), MASTER_PORT_RANGE=f"{only}-{only}",
                                      RUN_DIR=str(tmp_path / "claimed")))
        state = cluster.wait(job)
        log = (checkout / f"pretrieve-{job}.out").read_text()
        assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0" and state["Restarts"] == "0", log
        assert f"no free port found on ptnode1 in 100 tries from {only}-{only}" in log

        taken = listeners[0].getsockname()[1]
        job = cluster.submit("launchers/slurm/pretrain.sbatch", "configs/pretrain/tiny-mlm.yaml", cwd=checkout,
                             env=_env(MASTER_PORT=str(taken), RUN_DIR=str(tmp_path / "taken")))
        state = cluster.wait(job)
        log = (checkout / f"pretrieve-{job}.out").read_text()
        assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0" and state["Restarts"] == "0", log
        assert f"MASTER_PORT={taken} is taken on ptnode1" in log
    finally:
        for listener in listeners:
            listener.close()


def _listen(port: int) -> socket.socket:
    listener = socket.socket()
    listener.bind(("0.0.0.0", port))
    listener.listen()
    return listener


def test_a_follower_job_evaluates_a_training_jobs_checkpoints_and_ends_with_it(cluster, checkout, wiki_shards,
                                                                              tmp_path):
    """docs/evaluation.md's SLURM path for `farm --follow`: the follower is a job of its own (a one-line job list
    through eval_farm.sbatch), submitted beside the training job before its first checkpoint; it evaluates each
    checkpoint the run writes (steps 20 and 40), logs each as an MLflow run nested under the run's, and ends when
    the run has ended."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()  # the run is to start: the follower waits for its checkpoints
    scifact = ROOT / "pretrieve" / "assets" / "samples" / "beir" / "scifact-sample"
    farm = tmp_path / "farm.yaml"
    farm.write_text(f"out: {tmp_path / 'farm'}\ngpus: 0\neval: {{max_length: 32, depth: 20}}\n"
                    f"datasets: [{{name: scifact, beir: {scifact}}}]\nfollow: {{run_dir: {run_dir}, poll: 1}}\n")
    jobs = tmp_path / "follow.jobs"
    jobs.write_text(f"farm {farm} --follow {run_dir}\n")
    follower = cluster.submit("--array=0", "launchers/slurm/eval_farm.sbatch", str(jobs), cwd=checkout, env=_env())
    training = _pretrain(cluster, checkout, wiki_shards, run_dir, extra=["tracking.system_metrics_every=null"])
    _finished(cluster, training, checkout, restarts=0)
    state = cluster.wait(follower)
    log = (checkout / f"pretrieve-eval-{follower}_0.out").read_text()
    assert state["JobState"] == "COMPLETED", f"{state}\n{log[-3000:]}"
    followed = json.loads((tmp_path / "farm" / "run" / "follow.json").read_text())
    assert followed["evaluated"] == [20, 40] and not followed["skipped"], followed

    record = json.loads((run_dir / "run.json").read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    runs = client.search_runs([client.get_run(record["run_id"]).info.experiment_id], "tags.follow = 'run'")
    assert sorted(int(r.data.tags["step"]) for r in runs) == [20, 40]
    assert all(r.data.tags["mlflow.parentRunId"] == record["run_id"] for r in runs)
