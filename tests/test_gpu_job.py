"""`make gpu-check` (benchmarks/gpu_job.py) on a CPU machine: the dry run's plan against the budget, and every stage's
record written on success, failure, time-out, a spent budget and a job killed mid-stage."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import gpu_job
from benchmarks.gpu_job import Command, Stage

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.system


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_job", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


def test_dry_run_prints_each_stage_against_the_budget(tmp_path):
    done = _tool("--dry-run", "--stages", "all", "--bundle", str(tmp_path / "no-bundle"))
    for index, name in enumerate(("install", "correctness", "attention", "floor", "mfu", "profile", "profile-compile",
                                  "mfu-models", "mfu-methods", "quality", "recipe"), start=1):
        assert f"{index}. {name}" in done.stdout
    total = sum(stage.estimate_s for stage in gpu_job.plan("python", tmp_path, tmp_path, True, "0"))
    assert f"estimated total {total} s of 540 s" in done.stdout
    # 11 records, the summary and the logs: more than a job returns
    assert done.returncode == 1 and "13 files of the 8 a job returns: TOO MANY" in done.stdout
    # why compile lost: the compiled floor (profiled) beside its bf16 variant, and the engine's compile rung
    assert ("--variants bf16-compile bf16 --profile " in done.stdout
            and "--rung compile --set model.vocab_loss=plain" in done.stdout)
    # the methods added since the first ladder job: their ladder ends, coCondenser through GradCache
    assert ("--ladder --ends-only --no-peers --methods bow --skip unpad batch-128 decoder-fused vocab-liger cuda-graphs static-shapes --out"
            in done.stdout)
    assert ("--ladder --ends-only --no-peers --methods cocondenser --skip unpad batch-128 decoder-fused vocab-liger cuda-graphs static-shapes --set "
            "method.grad_cache.chunk=16") in done.stdout
    assert "make gpu-bundle" in done.stdout  # no bundle: said, since the install then needs network

    # what a job runs unless told (DEFAULT_STAGES: the speed ladder's job) fits the default budget
    assert gpu_job.DEFAULT_STAGES == ("install", "floor", "mfu", "profile")
    default = _tool("--dry-run", "--bundle", str(tmp_path / "no-bundle"))
    assert ("--ladder --methods mlm retromae --skip unpad batch-128 decoder-fused vocab-liger cuda-graphs static-shapes --top-only retromae "
            "--out") in default.stdout
    # the profile of the engine's step at batch 32 beside the floor's: the switches before unpadding and compile
    assert ("--rung fused-adamw --set model.vocab_loss=plain --set train.optimizer=torch-fused --set model.unpad=false "
            "--set train.compile=false --set train.precision=bf16-autocast --set train.low_precision_norm=true "
            "--batch 32 --profile") in default.stdout
    assert "-m benchmarks.step_floor --method mlm --size base --seq-len 512 --batch 32" in default.stdout
    assert "--variants autocast autocast-lpnorm bf16 --out" in default.stdout
    assert "pytest -q -rs -p no:cacheprovider tests/test_sdpa_kernels_gpu.py" in default.stdout
    total = sum(stage.estimate_s for stage in gpu_job.plan("python", tmp_path, tmp_path, True, "0")
                if stage.name in gpu_job.DEFAULT_STAGES)
    assert default.returncode == 0 and f"estimated total {total} s of 540 s: fits" in default.stdout, default.stdout

    over = _tool("--dry-run", "--budget", str(total - 1), "--bundle", str(tmp_path / "no-bundle"))
    assert over.returncode == 1 and "OVER BUDGET" in over.stdout


def test_dry_run_checks_what_a_job_carries(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "wheelhouse").mkdir(parents=True)
    (bundle / "data.tar.gz").write_bytes(os.urandom(2 << 20))
    done = _tool("--dry-run", "--bundle", str(bundle))
    assert done.returncode == 0 and "bundle/ 2.0 MiB" in done.stdout and "fits" in done.stdout
    (bundle / "wheelhouse" / "big.whl").write_bytes(b"\0" * (64 << 20))
    too_big = _tool("--dry-run", "--bundle", str(bundle))
    assert too_big.returncode == 1 and "TOO LARGE" in too_big.stdout


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_stage_writes_its_record_whatever_its_end(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    results, scores = work / "r.json", work / "s.json"
    write = f"open({str(results)!r}, 'w').write('{{\"x\": 1}}'); open({str(scores)!r}, 'w').write('[2]')"
    stages = [
        Stage("install", "sanity", 1, 30, [Command(_python(write), results=str(results),
                                                   also=(str(scores), str(work / "absent.json")))], needs_cuda=False),
        Stage("fails", "exits 3 after a line", 1, 30, [Command(_python("print('broken here'); raise SystemExit(3)")),
                                                       Command(_python("print('still runs')"))]),
        Stage("slow", "over what the budget leaves it", 1, 600, [Command(_python("import time; time.sleep(60)"))]),
        Stage("late", "no budget left", 1, 30, [Command(_python("pass"))]),
    ]
    # the first two stages have 5 s, however loaded the machine; "slow" then runs to the budget's end
    summary = gpu_job.run(stages, out, work, budget=10, summary={"plan": []})
    records = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(records) == ["0-summary.json", "1-install.json", "2-fails.json", "3-slow.json", "4-late.json"]
    install = records["1-install.json"]
    assert install["status"] == "ok" and install["results"] == {"r.json": {"x": 1}, "s.json": [2]}  # absent: left out
    failed = records["2-fails.json"]
    assert failed["status"] == "failed" and failed["commands"][0]["rc"] == 3
    assert "broken here" in failed["commands"][0]["log_tail"] and failed["commands"][1]["status"] == "ok"
    slow = records["3-slow.json"]
    assert slow["status"] == "timeout" and slow["seconds"] < 30
    assert records["4-late.json"]["status"] == "skipped" and "budget" in records["4-late.json"]["why"]
    assert summary["stages"]["slow"]["status"] == "timeout"
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
        log = tar.extractfile("logs/2-fails.log").read().decode()
    assert {"logs/1-install.log", "logs/2-fails.log", "logs/3-slow.log"} <= set(names)
    assert "broken here" in log and "still runs" in log


def test_stages_that_need_the_device_are_skipped_when_the_install_stage_fails(tmp_path):
    stages = [Stage("install", "no device", 1, 30, [Command(_python("raise SystemExit(1)"))], needs_cuda=False),
              Stage("kernels", "needs CUDA", 1, 30, [Command(_python("pass"))]),
              Stage("host", "does not", 1, 30, [Command(_python("pass"))], needs_cuda=False)]
    gpu_job.run(stages, tmp_path / "out", tmp_path / "work", budget=60, summary={})
    status = {p.stem: json.loads(p.read_text()).get("status") for p in (tmp_path / "out").glob("[1-9]-*.json")}
    assert status == {"1-install": "failed", "2-kernels": "skipped", "3-host": "ok"}


def test_the_real_job_on_a_machine_without_cuda_records_every_stage(tmp_path):
    out = tmp_path / "out"
    stages = ("install", "correctness", "attention", "mfu", "quality", "recipe")
    done = _tool("--no-install", "--stages", ",".join(stages), "--out", str(out), "--work", str(tmp_path / "work"),
                 "--budget", "120", "--bundle", str(tmp_path / "no-bundle"))
    assert done.returncode == 0, done.stderr
    install = json.loads((out / "1-install.json").read_text())
    assert install["status"] == "failed" and install["results"]["sanity.json"]["cuda_available"] is False
    assert "no CUDA device" in install["commands"][-1]["log_tail"]
    for index, name in enumerate(stages[1:], start=2):
        record = json.loads((out / f"{index}-{name}.json").read_text())
        assert record["status"] == "skipped" and "no CUDA device" in record["why"], record
    summary = json.loads((out / "0-summary.json").read_text())
    assert isinstance(summary["uncommitted"], list)  # the tracked files changed since `commit`, which ran too
    assert summary["node"]["torch"] and set(summary["stages"]) == set(stages)
    assert (out / "logs.tar.gz").is_file() and len(list(out.iterdir())) == 8  # what comes back from a job

    # one stage more and a record would not come back: refused before anything runs
    refused = _tool("--no-install", "--stages", "all", "--out", str(tmp_path / "out-all"), "--bundle",
                    str(tmp_path / "no-bundle"))
    assert refused.returncode == 2 and "a job returns the records of 6" in refused.stderr
    assert not (tmp_path / "out-all").exists()


def test_recipe_stage_runs_the_budget_until_it_is_committed_then_the_arms(tmp_path):
    committed = tmp_path / "results" / "recipe-gpu-short.json"
    first = gpu_job.recipe_commands("py", tmp_path / "work", tmp_path / "bundle", "1-2", committed)
    assert len(first) == 1 and first[0].argv[first[0].argv.index("--part") + 1] == "budget"
    committed.parent.mkdir()
    committed.write_text(json.dumps({"budget": {"mean": {}}}))
    committed.with_name("recipe-gpu-short-per-query.json").write_text("{}")
    copy_results, copy_scores, run = gpu_job.recipe_commands("py", tmp_path / "work", tmp_path / "bundle", "1-2",
                                                               committed)
    # the committed seeds are copied where the job merges into them, and both files come back in the record
    assert copy_results.argv == ["cp", str(committed), str(tmp_path / "work" / committed.name)]
    assert copy_scores.argv[-1] == str(tmp_path / "work" / "recipe-gpu-short-per-query.json")
    assert run.argv[run.argv.index("--part") + 1:run.argv.index("--part") + 4] == ["arms", "--seeds", "1-2"]
    assert run.argv[run.argv.index("--out") + 1] == str(tmp_path / "work" / "quality")  # the quality stage's base
    assert run.results == copy_results.argv[-1] and run.also == (copy_scores.argv[-1],)


def test_a_job_killed_mid_stage_keeps_what_it_measured(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    script = ("import sys; from benchmarks import gpu_job as g\n"
              f"g.run([g.Stage('first', '', 1, 30, [g.Command([sys.executable, '-c', 'print(1)'])], needs_cuda=False),"
              f" g.Stage('second', '', 1, 300, [g.Command([sys.executable, '-c', 'import time; time.sleep(300)'])],"
              f" needs_cuda=False)], g.Path({str(out)!r}), g.Path({str(work)!r}), 600, {{}})")
    job = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, start_new_session=True)
    try:
        second = out / "2-second.json"
        deadline = time.monotonic() + 120
        while not (second.is_file() and json.loads(second.read_text())["status"] == "running"):
            assert time.monotonic() < deadline and job.poll() is None, "the second stage never started"
            time.sleep(0.2)
    finally:
        stages = psutil.Process(job.pid).children(recursive=True)  # each in a session of its own
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        for child in stages:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    assert json.loads((out / "1-first.json").read_text())["status"] == "ok"
    assert json.loads(second.read_text())["status"] == "running"
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert tar.getnames() == ["logs/1-first.log"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no half-written file


@pytest.mark.parametrize("text,seeds", [("0", {0}), ("1-2", {1, 2}), ("0,2", {0, 2}), (None, None)])
def test_quality_seeds_option(text, seeds):
    from pretrieve.study.studies import parse_seeds

    assert parse_seeds(text) == seeds
    with pytest.raises(ValueError, match="--seeds"):
        parse_seeds("a-b")


def test_quality_results_name_paths_relative_to_the_repository():
    from pretrieve.study.results import relative_paths

    inside, beside = str(ROOT / "bench-out" / "x"), str(ROOT.parent / "shared" / "data" / "beir")
    assert relative_paths({"a": [inside, {"b": beside}], "c": "/elsewhere/x", "d": 1}, ROOT) == {
        "a": ["bench-out/x", {"b": "../shared/data/beir"}], "c": "/elsewhere/x", "d": 1}
