"""Preemption and export from the training loop: SIGTERM -> checkpoint -> exit 85 -> resume=auto finishes with
the same final weights as an uninterrupted run, also when the signal comes during start-up; Ctrl-C (SIGINT) ->
checkpoint -> one line -> the process ends by SIGINT, and a second one ends it at once; the run's export loads
in AutoModel."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from fault_runs import assert_same_run, with_fault
from inject_fault import release
from support import free_port, json_lines, pretrain_env, signal_in_mask
from transformers import AutoModel

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def _command(run_dir, wiki_shards, *overrides):
    return [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-mlm.yaml"), f"run_dir={run_dir}",
            f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
            "train.log_every=1", "checkpoint.every=1000", *overrides]


STEPS = "train.max_steps=12"


@pytest.fixture(scope="module")
def full(tmp_path_factory, wiki_shards) -> Path:
    """The uninterrupted run."""
    run = tmp_path_factory.mktemp("stop") / "full"
    subprocess.run(_command(run, wiki_shards, STEPS), env=pretrain_env(), check=True, capture_output=True)
    return run


def _paused_at(step: int, command: list[str], mark: Path, **popen) -> subprocess.Popen:
    """The run started by tests/inject_fault.py, paused right after step `step` is logged, before its stop check:
    a signal sent while it waits lands at that step however loaded the machine is."""
    env = pretrain_env(FAULT_AT="step", FAULT_STEP=str(step), FAULT_DO="pause", FAULT_MARK=str(mark))
    proc = subprocess.Popen(with_fault(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
    deadline = time.time() + 300
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert mark.exists(), proc.communicate(timeout=300)[1][-2000:] if proc.poll() is not None else "no pause"
    return proc


def test_sigterm_checkpoints_exits_85_and_resume_matches(tmp_path, wiki_shards, full):
    steps = STEPS

    run, mark = tmp_path / "stopped", tmp_path / "paused"
    proc = _paused_at(3, _command(run, wiki_shards, steps), mark)  # after the first steps, preempted
    proc.send_signal(signal.SIGTERM)
    release(mark)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 85, err[-2000:]
    stopped_at = int((run / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert stopped_at == 3
    # the step and where it went, as Ctrl-C's line says them
    assert f"pretrieve pretrain: preempted: saved step {stopped_at} to {run / 'checkpoints'}/step{stopped_at:08d}; " \
           "exit 85 (resume=auto continues)" in err, err[-2000:]
    assert not (run / "export").exists()

    done = subprocess.run(_command(run, wiki_shards, steps, "resume=auto"), env=pretrain_env(), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_run(run, full)

    model = AutoModel.from_pretrained(run / "export")
    assert model.config.hidden_size == 64


def test_a_signal_during_start_up_exits_85_before_the_first_step(tmp_path, wiki_shards, full):
    """SIGUSR1 as soon as the process can take it, long before the training loop (torch is not even imported
    then): the process does not die of it, finishes its start-up, exits 85 with nothing trained and nothing
    logged, and resume=auto then trains the run the uninterrupted way."""
    run = tmp_path / "run"
    proc = subprocess.Popen(_command(run, wiki_shards, STEPS, "resume=auto"), env=pretrain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while proc.poll() is None and not signal_in_mask(proc.pid, signal.SIGUSR1, "SigCgt") and time.time() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 85, err[-2000:]
    assert "preempted, during start-up, before the first step; exit 85" in err
    assert not (run / "checkpoints" / "latest").exists() and not (run / "metrics.jsonl").exists()

    done = subprocess.run(_command(run, wiki_shards, STEPS, "resume=auto"), env=pretrain_env(), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_run(run, full)


def test_ctrl_c_saves_its_step_says_so_in_one_line_and_resume_matches(tmp_path, wiki_shards, full, sigint_at_default):
    """SIGINT to the process group, as a terminal sends Ctrl-C, after the step-4 checkpoint: a checkpoint at the
    step it came, one line naming it and no traceback, and the process ends by SIGINT (130 in a shell; not 85,
    which the SLURM launcher requeues). resume=auto then gives the uninterrupted run's losses and weights."""
    run, mark = tmp_path / "run", tmp_path / "paused"
    command = _command(run, wiki_shards, STEPS, "checkpoint.every=4", "tracking.enabled=false")
    proc = _paused_at(5, command, mark, start_new_session=True)  # its own process group, as a terminal's job
    assert signal_in_mask(proc.pid, signal.SIGINT, "SigCgt")  # caught: not ignored, not Python's KeyboardInterrupt
    os.killpg(proc.pid, signal.SIGINT)
    release(mark)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGINT, err[-2000:]
    stopped_at = int((run / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert stopped_at == 5  # the step it came at, off the checkpoint schedule
    assert [line for line in err.splitlines() if "interrupt" in line.lower()] == [
        f"pretrieve pretrain: interrupted: saved step {stopped_at} to {run / 'checkpoints' / f'step{stopped_at:08d}'}; "
        "resume with resume=auto"]
    assert "Traceback" not in err, err[-3000:]
    assert not json_lines(out) and not (run / "export").exists()  # no result line: the run did not finish

    done = subprocess.run(command + ["resume=auto"], env=pretrain_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_run(run, full)


_INTERRUPT = ("import os, signal, sys, time\n"
              "from pretrieve.engine.preemption import Stop, StopFlag, hold_stop_signals\n"
              "hold_stop_signals(['pretrain'])\n"
              "stop = StopFlag(max_runtime=None)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "print(stop.should_stop(world=1).name, signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"  # at once: well within the repeat window of SIGTERM
              "time.sleep(float(sys.argv[1]))\n"
              "print('still running')\n")


def test_a_second_ctrl_c_ends_the_process_at_once_and_an_ignored_one_stays_ignored(sigint_at_default):
    """The first SIGINT asks for a checkpoint; a second, however soon (SLURM never repeats SIGINT, unlike SIGTERM),
    ends the process by SIGINT at once. Where SIGINT came ignored (`nohup`, a script's background job), a training
    process leaves it ignored, as Python does: neither one stops it."""
    done = subprocess.run([sys.executable, "-c", _INTERRUPT, "30"], capture_output=True, text=True, timeout=60)
    assert done.stdout == "INTERRUPTED False\n" and done.returncode == -signal.SIGINT, done.stderr[-2000:]

    ignored = subprocess.run(["sh", "-c", f"trap '' INT; exec {sys.executable} -c \"$0\" 0", _INTERRUPT],
                             capture_output=True, text=True, timeout=60)
    assert ignored.stdout == "NONE True\nstill running\n" and ignored.returncode == 0, ignored.stderr[-2000:]


def test_programs_started_under_the_shield_outlive_the_stop_signal():
    """As SLURM signals every process of a job step: a program started inside shield_children() (as ninja by
    DeepSpeed's JIT load) keeps the signal blocked and finishes; the trainer takes the signal when the shield
    ends. (/bin/sh clears the mask: what runs compilers through it is prebuild_ops' child, which ignores them.)"""
    script = ("import os, signal, subprocess, sys\n"
              "from pretrieve.engine.preemption import StopFlag, shield_children\n"
              "stop = StopFlag(max_runtime=None)\n"
              "with shield_children():\n"
              "    compiler = 'import time; time.sleep(0.5); print(\"compiled\")'\n"
              "    child = subprocess.Popen([sys.executable, '-c', compiler])\n"
              "    os.killpg(0, signal.SIGUSR1)\n"  # the whole process group: this process and its child
              "    assert child.wait() == 0\n"
              "print('requested', stop.requested, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "compiled\nrequested True\n"


def test_a_repeated_signal_is_one_request_and_a_later_one_exits_at_once():
    """The first SIGUSR1 asks for a checkpoint at the next step boundary; a repeat within the window is the same
    request delivered twice (slurmstepd and srun both signal a preempted task); a later one ends the process now
    (the last complete checkpoint stays `latest`: it moves only after a finished save)."""
    script = ("import os, signal, time\n"
              "from pretrieve.engine import preemption\n"
              "preemption.REPEAT_WINDOW_S = 1.0\n"
              "stop = preemption.StopFlag(max_runtime=None)\n"
              "os.kill(os.getpid(), signal.SIGUSR1)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "assert stop.should_stop(world=1)\n"
              "print('asked', flush=True)\n"
              "time.sleep(1.5)\n"
              "os.kill(os.getpid(), signal.SIGUSR1)\n"
              "time.sleep(float(sys.argv[1]))\n"
              "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == "asked\n" and done.returncode == 128 + signal.SIGUSR1, done.stderr[-2000:]


def _wrapped_timeout() -> RuntimeError:
    error = RuntimeError("rendezvous failed")
    error.__cause__ = TimeoutError("the store did not answer")
    return error


@pytest.mark.parametrize("error, may_pass", [
    (lambda: dist.DistNetworkError("connect to ptnode1:20002 timed out"), True),
    (lambda: ConnectionRefusedError(111, "Connection refused"), True),
    (_wrapped_timeout, True),
    (lambda: RuntimeError("Error building extension 'deepspeed_shm_comm'"), False),
    (lambda: ValueError("train.zero_stage: must be 0-3"), False),
])
def test_start_up_failures_that_may_pass_exit_86_and_others_are_raised(error, may_pass):
    from pretrieve.engine.preemption import RETRY_EXIT_CODE, StartupFailed, retryable_startup

    failure = error()
    with pytest.raises(StartupFailed if may_pass else type(failure)) as raised:
        with retryable_startup("joining the job"):
            raise failure
    assert raised.value.code == RETRY_EXIT_CODE if may_pass else raised.value is failure


def test_a_master_port_taken_when_rank_0_binds_is_named_and_may_pass(capsys, monkeypatch):
    """Two jobs that chose one port before either listened: the later rank 0's store cannot bind it. The start
    exits 86 (the SLURM script requeues it and chooses again), naming the port, not hanging."""
    from datetime import timedelta

    from pretrieve.engine.preemption import RETRY_EXIT_CODE, StartupFailed, retryable_startup

    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(StartupFailed) as raised:
            with retryable_startup("joining the job"):
                dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
    assert raised.value.code == RETRY_EXIT_CODE
    assert f"MASTER_PORT {port} is taken on 127.0.0.1 by another process" in capsys.readouterr().err


def test_a_start_up_past_its_deadline_exits_86():
    """As a rank whose peer died while the process group formed: blocked in C (here a sleep), ended by the
    watchdog with the retry code; a start-up that finishes in time leaves nothing behind."""
    script = ("import time\n"
              "from pretrieve.engine.preemption import retryable_startup\n"
              "with retryable_startup('joining the job', deadline=30):\n"
              "    pass\n"
              "with retryable_startup('joining the job', deadline=0.5):\n"
              "    time.sleep(60)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 86, done.stderr[-2000:]
    assert "joining the job did not finish in 0.5 s (train.startup_timeout)" in done.stderr


def test_the_command_line_is_built_without_importing_torch():
    """Every command's parser is built before its stop handlers are in place (eval's Ctrl-C line, the training
    commands' held signals): a parser that imports torch (seconds) would take a Ctrl-C as a traceback there."""
    done = subprocess.run([sys.executable, "-c", "import sys; from pretrieve.cli import main\n"
                           "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')))"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines()[-1] == "[]", done.stdout[-2000:]


def _allreduce_buffers(port: str) -> list[Path]:
    """DeepSpeed's CPU all-reduce buffers of the runs on `port` (one per rank, named after it)."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def test_a_one_rank_run_unlinks_its_cpu_allreduce_buffer(tmp_path, wiki_shards):
    """One rank, as srun or the deepspeed launcher start it (LOCAL_SIZE=1, MASTER_ADDR set): DeepSpeed maps its
    64 MiB buffer at world size 1 too; a finished run leaves nothing in /dev/shm."""
    port = free_port()
    env = pretrain_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port)
    done = subprocess.run(_command(tmp_path / "run", wiki_shards, "train.max_steps=1", "tracking.enabled=false"),
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _allreduce_buffers(port)


def test_a_start_up_past_its_deadline_unlinks_its_cpu_allreduce_buffer(tmp_path, wiki_shards):
    """Two ranks on one machine; rank 1 forms DeepSpeed's communication (its process group and shared-memory
    buffers) and then goes no further, as a rank that hangs or dies there: rank 0 waits for it in
    deepspeed.initialize until train.startup_timeout, exits 86, and its buffer is gone from /dev/shm with it."""
    port = free_port()
    env = pretrain_env(WORLD_SIZE="2", LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # the engine's extension cache, where `make install` built the CPU op: in torch's default one the peer built
    # it anew, past rank 0's deadline, and never formed the group
    peer = subprocess.Popen([sys.executable, "-c", "import time, deepspeed\n"
                             "from pretrieve.engine.ops import environment_ops\nwith environment_ops():\n"
                             "    deepspeed.init_distributed(dist_backend='gloo')\ntime.sleep(600)\n"],
                            env={**env, "RANK": "1", "LOCAL_RANK": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        done = subprocess.run(_command(tmp_path / "run", wiki_shards, "train.max_steps=1", "tracking.enabled=false",
                                       "train.startup_timeout=30"),
                              env={**env, "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True, text=True, timeout=300)
    finally:
        peer.kill()
        peer.wait()
        for buffer in _allreduce_buffers(port):  # the stand-in peer's own, which it never unlinks
            if buffer.name.endswith("_1"):
                buffer.unlink()
    assert done.returncode == 86, done.stderr[-3000:]
    assert "did not finish in 30 s (train.startup_timeout)" in done.stderr
    assert not _allreduce_buffers(port)
