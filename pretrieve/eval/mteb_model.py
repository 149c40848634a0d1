"""An export as an MTEB encoder: the `mteb` package (2.x) encodes a task's texts through pretrieve's own dense
encoder (eval.encode.DenseEncoder), so MTEB reads the model as `pretrieve eval` does: the export's pooling,
normalisation, maximum length and bidirectional attention (eval.model_config). MTEB's prompt types map to the
export's prompts: `query` to its query prompt (and a CoT-MoTE export's query experts), `document` to its passage
prompt. MTEB's per-task instructions are not added: the export's prompts are what it was trained or configured
with. Scores are inner products (cosine when the encoding normalises), as in `pretrieve eval`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction
from mteb.types import PromptType

from pretrieve.eval.encode import DenseEncoder
from pretrieve.eval.model_config import Encoding

REVISION = "local"  # an export has no hub revision; MTEB's result folders are named after it


def model_name(model_dir: str | Path) -> str:
    """The export's MTEB model name (its result folder `pretrieve__<name>`): `pretrieve/<folder>`, a run's
    export (RUN/export) named for its run, as its model card is."""
    folder = Path(model_dir).resolve()
    return f"pretrieve/{folder.parent.name if folder.name == 'export' else folder.name}"


class ExportEncoder(AbsEncoder):
    """MTEB's EncoderProtocol over a DenseEncoder; `mteb_model_meta` names the export and its similarity."""

    def __init__(self, model_dir: str | Path, encoding: Encoding, batch_size: int, progress: bool = True,
                 dim: int | None = None):  # dim: the vectors' first N coordinates (a Matryoshka prefix)
        self.encoder = DenseEncoder(model_dir, replace(encoding.encode_options(batch_size), dim=dim))
        self.progress = progress
        self.mteb_model_meta = ModelMeta.create_empty({
            "name": model_name(model_dir), "revision": REVISION,
            "embed_dim": self.encoder.dim, "max_tokens": encoding.max_length, "framework": ["PyTorch"],
            "similarity_fn_name": ScoringFunction.COSINE if encoding.normalize else ScoringFunction.DOT_PRODUCT, "modalities": ["text"]})

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type: PromptType | None = None,
               **kwargs) -> np.ndarray:
        """[texts, hidden] float32 vectors of a task's texts, queries through the query prompt (and experts)."""
        texts = [text for batch in inputs for text in batch["text"]]
        queries = prompt_type == PromptType.query
        return self.encoder.encode(texts, desc=f"{task_metadata.name}: encode {'queries' if queries else 'corpus'}",
                                   progress=self.progress, queries=queries)
