"""One invocation of a method study: its study file, the settings it runs with, its work directory, the data it
reads and its results file; and where each input is: the shared data (`pretrain/`: the Wikipedia sample and the
books, `beir/`: the collections) or, for a smoke run, the bundled samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pretrieve.study.study_file import MethodStudy

SAMPLES = Path(__file__).resolve().parent.parent / "assets" / "samples"
DATA = Path("../shared/data")  # the default --data: the shared data beside the repository
WIKIPEDIA = Path("pretrain") / "enwiki-sample" / "enwiki_2015_wikiextractor_100shards.jsonl.gz"


@dataclass
class StudyRun:
    study: MethodStudy
    plan: dict  # the quality study's settings, as this run fixes them (study/plan.py)
    work: Path
    results: Path
    data: Path = DATA
    smoke: bool = False

    def config_of(self, arm: str) -> str:
        """The pre-training config of an arm."""
        return self.study.config("pretrain").replace("{arm}", arm)

    def wikipedia(self) -> Path:
        return SAMPLES / "wikipedia" / "wiki_00.jsonl.gz" if self.smoke else self.data / WIKIPEDIA

    def books(self) -> list[Path]:
        return sorted((SAMPLES / "books" if self.smoke else self.data / "pretrain" / "gutenberg").glob("*.txt"))

    def collection(self, name: str) -> Path:
        """A BEIR collection by name (`scifact-sample`: the bundled sample)."""
        if name == "scifact-sample":
            return SAMPLES / "beir" / "scifact-sample"
        return self.data / "beir" / name


def check_data(folder: Path) -> None:
    """The shared data must be there before any work: `pretrain/` and `beir/`."""
    missing = [name for name in ("pretrain", "beir") if not (folder / name).is_dir()]
    if missing:
        raise ValueError(f"--data {folder}: no {' or '.join(missing)} folder there (the shared data: pretrain/, "
                         "beir/)")
