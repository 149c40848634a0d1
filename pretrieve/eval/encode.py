"""Dense encoding of texts with an exported encoder (a HF directory: `pretrieve export`, or any BERT-like model).

Texts are tokenized once, sorted by length and batched, so a batch pads only to its own longest text (on
SciFact at 256 tokens this skips most of the padding a corpus-order batch carries); vectors come back in
input order. Pooling: `cls` (the [CLS] vector, the RetroMAE family) or `mean` (over non-padding tokens,
sentence-transformers); `normalize` makes inner product cosine. bf16 autocast on a GPU, fp32 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pretrieve.models.representation import POOLINGS


@dataclass
class EncodeOptions:
    pooling: str = "cls"
    max_length: int = 256
    batch_size: int = 64
    normalize: bool = False


class DenseEncoder:
    def __init__(self, model_dir: str | Path, options: EncodeOptions, device: str | None = None):
        from transformers import AutoModel, AutoTokenizer

        if options.pooling not in POOLINGS:
            raise ValueError(f"pooling: {options.pooling!r} is not one of {', '.join(POOLINGS)}")
        if not Path(model_dir).is_dir():
            raise ValueError(f"{model_dir}: not a model directory (expected a HF export with config and tokenizer)")
        self.options = options
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).to(self.device).eval()

    @torch.inference_mode()
    def encode(self, texts: list[str], desc: str = "encode", progress: bool = True) -> np.ndarray:
        """[len(texts), hidden] float32 vectors, in the order of `texts`."""
        from tqdm import tqdm

        ids = self.tokenizer(texts, truncation=True, max_length=self.options.max_length,
                             add_special_tokens=True)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = np.empty((len(texts), self.model.config.hidden_size), dtype=np.float32)
        pool = POOLINGS[self.options.pooling]
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        size = self.options.batch_size
        for start in tqdm(range(0, len(order), size), desc=desc, unit="batch", disable=not progress, leave=False):
            rows = order[start:start + size]
            batch = self.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt").to(self.device)
            with autocast:
                hidden = self.model(**batch).last_hidden_state
            vectors = pool(hidden.float(), batch["attention_mask"])
            if self.options.normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            out[rows] = vectors.cpu().numpy()
        return out
