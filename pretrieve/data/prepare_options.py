"""The options of `pretrieve prepare`: each flag as a field, their checks naming the flag, and which of them
identify the output (prepare.py runs a job of them)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from pretrieve.data import corpora, pairs
from pretrieve.data.hf_datasets import HFDataset
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.utils.options import default_of

PASSAGE_SOURCES = ("msmarco-passage", "beir")  # one text per sample by default


class PrepareError(RuntimeError):
    pass


@dataclass
class PrepareOptions:
    source: str
    inputs: list[str]
    out: str
    tokenizer: str = DEFAULT_TOKENIZER
    max_len: int = 512
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    shard_size: int = 10000
    on_error: str = "fail"  # fail | skip
    packing: str | None = None  # sentences | passage; None = passage for passage corpora, else sentences
    short_seq_prob: float = 0.0
    seed: int = 42
    text_field: str = "text"
    id_field: str = "id"
    title_field: str | None = "title"
    queries_field: str | None = "queries"
    books_format: str = "file"
    overwrite: bool = False
    progress: bool | None = None  # None/True: a bar on a terminal, periodic lines otherwise; False: silent
    holdout: float = 0.0  # share of documents on the validation side (0: no split)
    split: str = "train"  # which side this output holds when holdout > 0: train | validation
    stage: str | None = None  # remote `out`: the local folder the job runs in before the upload
    part: int = 0  # this job's share of the input: record groups part, part + parts, part + 2 parts, ...
    parts: int = 1
    group_records: int = 100_000  # consecutive records per group; no shard spans two groups
    # --pairs: (query, positive, negatives) samples (pairs.py says what each source gives)
    pairs: bool = False
    pair_method: str | None = None  # sections | spans | qrels | records; None: the source's first (pairs.PAIR_METHODS)
    span_method: str = "crop"  # spans: crop (Contriever's two independent crops) | ict (sentence -> its context)
    crop_ratio_min: float = 0.1  # crop: a crop's share of its block, drawn uniformly (Contriever's 0.1-0.5)
    crop_ratio_max: float = 0.5
    ict_keep_prob: float = 0.1  # ict: how often the sentence stays in its context (Lee et al. 2019: 0.1)
    qrels_split: str = "train"  # msmarco / beir: the qrels the pairs come from
    query_field: str = "query"  # records: the fields of a pair (--fields query=... pos=... neg=...)
    pos_field: str = "pos"
    neg_field: str = "neg"
    # a Hugging Face dataset streamed in place of `inputs` (hf_datasets.py)
    hf_dataset: str | None = None  # what datasets.load_dataset takes: a Hub name, a folder, or a builder
    hf_config: str | None = None
    hf_split: str | None = None  # None: train, where the dataset has splits
    hf_data_files: list[str] | None = None
    hf_rows_per_document: int = 1  # consecutive rows that make one document (a dataset of one sentence a row)

    def dataset(self) -> HFDataset | None:
        if self.hf_dataset is None:
            return None
        return HFDataset(self.hf_dataset, self.hf_config, self.hf_split, tuple(self.hf_data_files or ()),
                         self.hf_rows_per_document)

    def resolved_packing(self) -> str:
        return self.packing or ("passage" if self.source in PASSAGE_SOURCES else "sentences")

    def resolved_pair_method(self) -> str | None:
        return (self.pair_method or pairs.default_method(self.source)) if self.pairs else None

    def validate(self) -> None:
        if bool(self.inputs) == (self.hf_dataset is not None):
            raise PrepareError("give the corpus as --input PATH... or as --hf-dataset NAME, one of the two")
        if self.hf_dataset is None and (self.hf_config or self.hf_split or self.hf_data_files
                                        or self.hf_rows_per_document != 1):
            raise PrepareError("--hf-config, --hf-split, --hf-data-files and --hf-rows-per-document go with "
                               "--hf-dataset")
        if self.hf_rows_per_document < 1:
            raise PrepareError(f"--hf-rows-per-document must be positive, got {self.hf_rows_per_document}")
        if self.hf_dataset is not None:
            self.dataset().check()
        if self.pairs:
            self._validate_pairs()
        elif self.source not in corpora.SOURCES:
            raise PrepareError(f"--source {self.source!r}: choose one of {', '.join(corpora.SOURCES)}")
        if self.max_len < 4:
            raise PrepareError(f"--max-len must be at least 4, got {self.max_len}")
        if self.shard_size < 1:
            raise PrepareError(f"--shard-size must be positive, got {self.shard_size}")
        if self.on_error not in ("fail", "skip"):
            raise PrepareError(f"--on-error must be fail or skip, got {self.on_error!r}")
        if self.resolved_packing() not in ("sentences", "passage"):
            raise PrepareError(f"--packing must be sentences or passage, got {self.packing!r}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise PrepareError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if not 0.0 <= self.holdout < 1.0:
            raise PrepareError(f"--holdout must be in [0, 1), got {self.holdout}")
        if self.split not in ("train", "validation"):
            raise PrepareError(f"--split must be train or validation, got {self.split!r}")
        if self.split == "validation" and self.holdout == 0.0:
            raise PrepareError("--split validation needs --holdout FRACTION > 0")
        if self.books_format not in ("file", "lines"):
            raise PrepareError(f"--books-format must be file or lines, got {self.books_format!r}")
        if not 0 <= self.part < self.parts:
            raise PrepareError(f"--part must be in [0, --parts), got part {self.part} of {self.parts}")
        if self.group_records < 1:
            raise PrepareError(f"--group-records must be positive, got {self.group_records}")

    def _validate_pairs(self) -> None:
        if self.source not in pairs.PAIR_SOURCES:
            raise PrepareError(f"--pairs --source {self.source!r}: choose one of {', '.join(pairs.PAIR_SOURCES)}")
        if self.resolved_pair_method() not in pairs.PAIR_METHODS[self.source]:
            raise PrepareError(f"--pair-method {self.pair_method!r}: --source {self.source} takes "
                               f"{' or '.join(pairs.PAIR_METHODS[self.source])}")
        if self.span_method not in pairs.SPAN_METHODS:
            raise PrepareError(f"--span-method must be crop or ict, got {self.span_method!r}")
        if not 0.0 < self.crop_ratio_min <= self.crop_ratio_max <= 1.0:
            raise PrepareError(f"--crop-ratio-min/max must satisfy 0 < min <= max <= 1, got {self.crop_ratio_min}, "
                               f"{self.crop_ratio_max}")
        if not 0.0 <= self.ict_keep_prob <= 1.0:
            raise PrepareError(f"--ict-keep-prob must be in [0, 1], got {self.ict_keep_prob}")
        if self.hf_dataset is not None and self.resolved_pair_method() == "qrels":
            raise PrepareError(f"--pairs --source {self.source} joins a folder's corpus, queries and qrels; it "
                               "reads --input FOLDER, not --hf-dataset (prepare the rows as --source jsonl)")
        if self.hf_rows_per_document != 1 and self.resolved_pair_method() == "records":
            raise PrepareError("--hf-rows-per-document joins rows into documents; a pair record is one row")
        if self.parts > 1:  # duplicates are dropped over the whole input, which no part sees
            raise PrepareError("--pairs prepares in one job (--parts 1): duplicate pairs are dropped over the "
                               "whole input")

    def wanted(self):
        """The record indices this part prepares (None: all)."""
        if self.parts == 1:
            return None
        return lambda index: (index // self.group_records) % self.parts == self.part

    def output_arguments(self) -> dict:
        """The arguments that determine the output (not workers, progress, overwrite)."""
        args = asdict(self)
        for key in ("workers", "progress", "overwrite", "out", "stage"):
            args.pop(key)
        args["packing"] = self.resolved_packing()
        for key in _LATER_KEYS:  # jobs that do not use them keep the ids they had before these existed
            if args[key] == default_of(PrepareOptions, key):
                args.pop(key)
        pair_keys = ("pairs", "pair_method", "span_method", "crop_ratio_min", "crop_ratio_max", "ict_keep_prob",
                     "qrels_split")
        if not self.pairs:  # text jobs keep the ids they had before pairs existed
            for key in pair_keys:
                args.pop(key)
        else:
            args["pair_method"] = self.resolved_pair_method()
        return args

    def span_options(self) -> pairs.SpanOptions:
        return pairs.SpanOptions(self.span_method, self.crop_ratio_min, self.crop_ratio_max, self.ict_keep_prob,
                                 self.seed)


_LATER_KEYS = ("query_field", "pos_field", "neg_field", "hf_dataset", "hf_config", "hf_split", "hf_data_files",
               "hf_rows_per_document")
