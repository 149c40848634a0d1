"""The options of `pretrieve eval` and `pretrieve encode`, light (no torch): the command line takes its flags'
defaults from these classes while it builds its parser (utils.options.default_of), so each default is written
once, here."""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_BATCHES = 64  # batches per window when EncodeOptions.window is not given


@dataclass
class EvalOptions:
    out: str
    model: str | None = None
    beir: str | None = None
    msmarco: str | None = None
    split: str | None = "test"  # None with mteb: each task's own
    pooling: str | None = None  # None: what the model says (eval.model_config), else cls
    max_length: int | None = None  # None: what the model says, else 256
    normalize: bool | None = None  # None: what the model says, else off
    query_prompt: str | None = None  # None: what the model says (its sentence-transformers prompts), else none
    passage_prompt: str | None = None
    dim: int | None = None  # dense: the vectors' first N coordinates (Matryoshka), re-normalised; None: all
    batch_size: int = 64
    index: str = "flat"
    nprobe: int = 32  # ivf / ivfpq: lists searched
    ef_search: int | None = None  # hnsw: search breadth (None: max(128, depth))
    depth: int = 1000
    bm25: bool = False
    on_missing: str = "fail"
    vocab_top_k: int | None = None  # dupmae / sparse / hybrid: entries a document keeps (VocabEncoder's default)
    sparse_weight: float = 1.0  # hybrid: weight of the sparse score
    candidates: int | None = None  # hybrid / dupmae: per query (None: exact up to evaluate.EXACT_HYBRID_DOCS)
    embeddings: str | None = None  # dense: the corpus vectors `pretrieve encode` wrote there
    mteb: str | None = None  # MTEB tasks, benchmarks or BEIR folders, comma-separated (eval.mteb_eval)
    contrastive_entropy: int | None = None  # K negatives per judged pair (eval.contrastive); None: not computed
    ce_temperature: float = 1.0  # contrastive entropy: scores / tau (1.0: the raw inner product, as Fang et al.)
    ce_seed: int = 0  # contrastive entropy: the negatives' seed (the same for every model compared)
    overwrite: bool = False  # replace an earlier evaluation in `out` (else refused; eval.evaluate.check_eval_folder)
    progress: bool = True


@dataclass
class EncodeOptions:
    pooling: str = "cls"
    max_length: int = 256
    batch_size: int = 64
    normalize: bool = False
    window: int | None = None  # texts tokenized and length-sorted together; None: WINDOW_BATCHES batches
    query_prompt: str = ""  # put before each query (eval.model_config: the model's, or --query-prompt)
    passage_prompt: str = ""  # put before each passage
    dim: int | None = None  # the vectors' first N coordinates, before normalisation (Matryoshka); None: all
    # queries cut at this many tokens of their own after their prompt (mine's, as fine-tuning's query_max_len);
    # None: at max_length, which counts the prompt (as sentence-transformers' max_seq_length)
    query_own_length: int | None = None

    def window_size(self) -> int:
        return self.window or self.batch_size * WINDOW_BATCHES
