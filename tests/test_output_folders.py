"""No command removes what is not its own: each command that writes a folder (or a file) refuses one holding
something else, names what is there and leaves it as it was (utils/output_folder.py); an earlier output is
replaced only when asked, whole, through a folder beside it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import SAMPLES, pretrain_env
from pretrieve.cli import main as cli
from pretrieve.utils.output_folder import (OutputInUse, check_file_output, check_own_entries, check_whole_output,
                                           replace_directory)

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"


def foreign_folder(path: Path) -> dict:
    """The issue's folder: a model file in a subfolder, an empty subfolder and a data file. Returns its snapshot."""
    (path / "a").mkdir(parents=True)
    (path / "a" / "model.bin").write_bytes(b"\x00weights")
    (path / "b").mkdir()
    (path / "data.csv").write_text("id,text\n1,kept\n")
    return snapshot(path)


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def refused(args: list[str], capsys, *names: str) -> str:
    """Run `pretrieve ARGS` here; it must fail with one line naming each of `names`."""
    assert cli(args) != 0
    err = capsys.readouterr().err
    for name in names:
        assert name in err, err
    return err


def refused_either_way(args: list[str], capsys, folder: Path, *names: str) -> None:
    """`pretrieve ARGS` refused with and without --overwrite, naming each of `names`; `folder` left as it was."""
    before = snapshot(folder)
    for flags in ((), ("--overwrite",)):
        refused([*args, *flags], capsys, *names)
        assert snapshot(folder) == before


def test_whole_outputs_new_empty_earlier_or_refused(tmp_path):
    def earlier(path):
        return (path / "mark").is_file()

    check_whole_output(tmp_path / "new", "thing", earlier, overwrite=False)
    (tmp_path / "empty").mkdir()
    check_whole_output(tmp_path / "empty", "thing", earlier, overwrite=False)
    before = foreign_folder(tmp_path / "home")
    for overwrite in (False, True):
        with pytest.raises(OutputInUse, match=r"holds 3 entries that are not a thing \(a/, b/, data.csv\)"):
            check_whole_output(tmp_path / "home", "thing", earlier, overwrite)
    assert snapshot(tmp_path / "home") == before
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "mark").write_text("")
    with pytest.raises(OutputInUse, match="holds an earlier thing; pass --overwrite"):
        check_whole_output(tmp_path / "old", "thing", earlier, overwrite=False)
    check_whole_output(tmp_path / "old", "thing", earlier, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputInUse, match="exists and is not a folder"):
        check_whole_output(tmp_path / "file", "thing", earlier, overwrite=True)
    many = tmp_path / "many"
    many.mkdir()
    for i in range(8):
        (many / f"f{i}").write_text("")
    with pytest.raises(OutputInUse, match=r"\(f0, f1, f2, f3, f4 and 3 more\)"):
        check_whole_output(many, "thing", earlier, overwrite=False)


def test_own_entries_and_file_outputs(tmp_path):
    before = foreign_folder(tmp_path / "out")
    with pytest.raises(OutputInUse, match=r"holds 2 entries that the job does not write \(b/, data.csv\)"):
        check_own_entries(tmp_path / "out", "job", lambda name: name == "a")
    check_own_entries(tmp_path / "out", "job", lambda name: name == "a", earlier=lambda folder: True)
    check_own_entries(tmp_path / "none", "job", lambda name: False)
    assert snapshot(tmp_path / "out") == before
    target = tmp_path / "examples.jsonl"
    check_file_output(target, "examples", overwrite=False)
    target.write_text("{}\n")
    with pytest.raises(OutputInUse, match="exists; pass --overwrite"):
        check_file_output(target, "examples", overwrite=False)
    check_file_output(target, "examples", overwrite=True)
    with pytest.raises(OutputInUse, match="is a folder"):
        check_file_output(tmp_path / "out", "examples", overwrite=True)


def test_replace_directory_puts_back_an_output_a_stop_left_aside(tmp_path):
    out, tmp = tmp_path / "export", tmp_path / ".export.tmp"
    out.mkdir()
    (out / "v").write_text("1")
    tmp.mkdir()
    (tmp / "v").write_text("2")
    replace_directory(tmp, out)
    assert (out / "v").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    # a stop between the two renames of a swap: the old output aside, none in place, the new one half-made
    out.rename(tmp_path / ".export.old")
    tmp.mkdir()
    (tmp / "v").write_text("3")
    replace_directory(tmp, out)  # the old one comes back first, then is replaced as usual
    assert (out / "v").read_text() == "3" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, wiki_shards, tiny_encoder) -> dict:
    """A 2-step tiny MLM pre-training run and a 2-step tiny fine-tuning run, each with a checkpoint."""
    base = tmp_path_factory.mktemp("runs")
    made = {"pretrain": base / "mlm", "finetune": base / "tuned"}
    for args in (["pretrain", str(ROOT / "configs" / "pretrain" / "tiny-mlm.yaml"), f"run_dir={made['pretrain']}",
                  f"data.manifests=[{wiki_shards / 'manifest.json'}]"],
                 ["finetune", str(ROOT / "configs" / "finetune" / "tiny.yaml"), f"run_dir={made['finetune']}",
                  f"finetune.init_from={tiny_encoder}", f"finetune.data=[{FLAG}]"]):
        subprocess.run([sys.executable, "-m", "pretrieve", *args, "train.max_steps=2", "checkpoint.every=2",
                        "tracking.enabled=false"], check=True, capture_output=True, text=True, env=pretrain_env())
    return made


@pytest.mark.parametrize("kind", ["pretrain", "finetune"])
def test_export_refuses_a_foreign_folder_and_replaces_an_earlier_export_only_when_asked(tmp_path, capsys, runs,
                                                                                          kind):
    home = tmp_path / "models"
    foreign_folder(home)
    refused_either_way(["export", str(runs[kind]), str(home)], capsys, home,
                       "holds 3 entries that are not a pretrieve export (a/, b/, data.csv)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # nothing written beside it either

    out = tmp_path / "export"
    out.mkdir()  # an empty folder is taken
    assert cli(["export", str(runs[kind]), str(out)]) == 0 and (out / "config.json").is_file()
    first = snapshot(out)
    refused(["export", str(runs[kind]), str(out)], capsys, "holds an earlier pretrieve export; pass --overwrite")
    assert snapshot(out) == first
    (out / "config.json").write_text("{}")  # so that the replacement shows
    assert cli(["export", str(runs[kind]), str(out), "--overwrite"]) == 0
    assert snapshot(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["export", "models"]


def test_tokenizer_train_replaces_only_a_tokenizer_of_its_own(tmp_path, capsys):
    train = ["tokenizer", "train", "--source", "wikipedia", "--input", str(SAMPLES / "wikipedia"),
             "--vocab-size", "400", "--max-documents", "20"]
    home = tmp_path / "home"
    foreign_folder(home)
    refused_either_way([*train, "--out", str(home)], capsys, home, "not a tokenizer trained by pretrieve",
                       "a/, b/, data.csv")
    out = tmp_path / "tok"
    assert cli([*train, "--out", str(out)]) == 0
    refused([*train, "--out", str(out)], capsys, "holds an earlier tokenizer trained by pretrieve")
    assert cli([*train, "--out", str(out), "--overwrite", "--vocab-size", "500"]) == 0
    assert json.loads((out / "pretrieve_tokenizer.json").read_text())["requested_vocab_size"] == 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "tok"]


def test_prepare_refuses_a_foreign_folder_and_overwrites_only_its_own_files(tmp_path, capsys):
    prepare = ["prepare", "--source", "wikipedia", "--input", str(SAMPLES / "wikipedia")]
    home = tmp_path / "home"
    foreign_folder(home)
    (home / "backup.tar").write_bytes(b"not a shard")  # --overwrite once removed every *.tar
    refused_either_way([*prepare, "--out", str(home)], capsys, home, "that the pretrieve prepare does not write",
                       "backup.tar")
    out = tmp_path / "shards"
    assert cli([*prepare, "--out", str(out)]) == 0
    shards = sorted(p.name for p in out.glob("*.tar"))
    assert cli([*prepare, "--out", str(out), "--overwrite", "--shard-size", "5"]) == 0
    assert sorted(p.name for p in out.glob("*.tar")) != shards  # the old shards gone, the new ones in place
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(s["file"] for s in manifest["shards"])


def test_encode_mine_and_teacher_scores_leave_what_is_not_theirs(tmp_path, capsys, tiny_encoder):
    scifact = SAMPLES / "beir" / "scifact-sample"
    home = tmp_path / "home"
    before = foreign_folder(home)
    refused(["encode", "--model", str(tiny_encoder), "--beir", str(scifact), "--out", str(home)], capsys,
            "that the pretrieve encode does not write", "a/, b/, data.csv")
    assert snapshot(home) == before

    mined = tmp_path / "hard.jsonl"
    mined.write_text("kept\n")
    mine = ["mine", "--model", str(tiny_encoder), "--data", str(FLAG), "--depth", "5", "--negatives", "2"]
    refused([*mine, "--out", str(mined)], capsys, f"{mined}: exists; pass --overwrite")
    refused([*mine, "--out", str(home)], capsys, f"{home}: is a folder")
    assert mined.read_text() == "kept\n" and snapshot(home) == before
    assert cli([*mine, "--out", str(mined), "--overwrite"]) == 0
    assert len(mined.read_text().splitlines()) == 10

    scored = tmp_path / "distill.jsonl"
    scored.write_text("kept\n")
    refused(["teacher-scores", "--model", str(tiny_encoder), "--data", str(mined), "--out", str(scored)], capsys,
            f"{scored}: exists; pass --overwrite")
    assert scored.read_text() == "kept\n"


def test_report_farm_and_scale_refuse_a_foreign_folder(tmp_path, capsys, wiki_shards):
    home = tmp_path / "home"
    before = foreign_folder(home)
    refused(["report", "--uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--out", str(home)], capsys,
            "that the pretrieve report does not write", "a/, b/, data.csv")

    farm = tmp_path / "farm.yaml"
    farm.write_text(yaml.safe_dump({"out": str(home), "checkpoints": [{"name": "bm25", "bm25": True}],
                                    "datasets": [{"name": "s", "beir": str(SAMPLES / "beir" / "scifact-sample")}]}))
    refused(["farm", str(farm)], capsys, "that the pretrieve farm does not write", "a/, b/, data.csv")

    study = {"name": "grid", "methods": ["mlm"], "config": str(ROOT / "configs" / "pretrain" / "tiny-{method}.yaml"),
             "sizes": {"h32": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}},
             "budgets": {"tokens": [2048]}, "seeds": [0],
             "train": {"batch_size": 4, "seq_len": 64, "lr": 1e-3, "base_width": 64},
             "data": {"manifests": [str(wiki_shards / "manifest.json")]}, "run": {"out": str(home)}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    for command in ("plan", "run"):
        refused(["scale", command, str(path)], capsys, "that the scaling study does not write", "a/, b/, data.csv")
    assert snapshot(home) == before

    study["run"]["out"] = str(tmp_path / "study")
    path.write_text(yaml.safe_dump(study))
    assert cli(["scale", "plan", str(path)]) == 0
    path.write_text(yaml.safe_dump({**study, "name": "other"}))
    refused(["scale", "plan", str(path)], capsys, "holds the plan of study 'grid', not 'other'")


def test_eval_refuses_a_users_metrics_and_replaces_an_earlier_evaluation_only_when_asked(tmp_path, capsys,
                                                                                         tiny_encoder):
    """A user's own metrics.json (or anything else) is never overwritten, with or without --mteb; an earlier
    evaluation is replaced only with --overwrite, and a farm job's log is left beside it."""
    scifact = SAMPLES / "beir" / "scifact-sample"
    bm25 = ["eval", "--bm25", "--beir", str(scifact), "--depth", "10"]
    home = tmp_path / "home"
    home.mkdir()
    (home / "metrics.json").write_text('{"ndcg@10": 0.71, "note": "my own run"}\n')
    before = snapshot(home)
    refused_either_way([*bm25, "--out", str(home)], capsys, home,
                       "holds 1 entries that are not a pretrieve eval output (metrics.json); nothing was written")
    refused_either_way(["eval", "--model", str(tiny_encoder), "--mteb", str(scifact), "--out", str(home)], capsys,
                       home, "holds 1 entries that are not a pretrieve eval output (metrics.json)")
    (home / "metrics.json").unlink()
    before = foreign_folder(home)
    refused([*bm25, "--out", str(home)], capsys,
            "holds 3 entries that are not a pretrieve eval output (a/, b/, data.csv)")
    assert snapshot(home) == before

    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval.log").write_text("a farm job's log\n")  # the farm writes it before the job starts
    assert cli([*bm25, "--out", str(out)]) == 0
    first = snapshot(out)
    assert {"metrics.json", "run.trec", "per_query.jsonl", "eval.log"} <= first.keys()
    refused([*bm25, "--out", str(out)], capsys, "holds an earlier pretrieve eval output; pass --overwrite")
    assert snapshot(out) == first
    (out / "mlflow.json").write_text("{}")  # logged by a farm: a replaced evaluation is not that run any more
    assert cli([*bm25, "--depth", "5", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "metrics.json").read_text())["depth"] == 5
    assert not (out / "mlflow.json").exists() and (out / "eval.log").read_text() == "a farm job's log\n"
