"""`llama2vec` pooling: a Llama2Vec export reads each text as its pre-training did, followed by one of its prompts,
and the text's vector is the mean of that prompt's k special states (models/heads/llama2vec.py; LLARA's usage:
passages with the summarise prompt, queries with the predict one; an `ebae` or `ebar` export has one prompt
only, read for both). The vector is normalised when the encoding says so (LLARA normalises).

The rows are the training rows of data/llama2vec.py with one prompt: <bos> " text <prompt words> S1..Sk, the
text cut so that the row fits the encoding's maximum length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pretrieve.data.llama2vec import Llama2VecCollator
from pretrieve.data.masking import Vocabulary
from pretrieve.models.export import export_meta

LLAMA2VEC_METHODS = ("llama2vec", "ebae", "ebar")


@dataclass(frozen=True)
class PromptPooling:
    head: list[int]  # <bos> and the opening quote
    suffixes: dict[bool, list[int]]  # queries? -> the prompt's words and its k special tokens
    k: int

    @classmethod
    def of_export(cls, model_dir: str | Path) -> "PromptPooling":
        meta = export_meta(model_dir)
        if meta.get("method") not in LLAMA2VEC_METHODS:
            raise ValueError(f"pooling llama2vec: {model_dir} is no export of {', '.join(LLAMA2VEC_METHODS)} "
                             f"(its pretrieve_head.json says {meta.get('method')!r}); give another --pooling")
        options = meta["options"]
        vocab = Vocabulary.of_tokenizer(model_dir)
        rows = Llama2VecCollator(vocab, max_len=10_000, tasks="both", prompt_tokens=options["prompt_tokens"],
                                 summary_prompt=options["summary_prompt"], predict_prompt=options["predict_prompt"])
        trained = {"llama2vec": ("ebae", "ebar"), "ebae": ("ebae", "ebae"), "ebar": ("ebar", "ebar")}[meta["method"]]
        passages, queries = (rows.suffixes[task].tolist() for task in trained)
        return cls([vocab.cls_id, *rows.prefix], {False: passages, True: queries}, options["prompt_tokens"])

    def tokenize(self, tokenizer, texts: list[str], max_length: int, queries: bool) -> list[list[int]]:
        suffix = self.suffixes[queries]
        room = max_length - len(self.head) - len(suffix)
        if room < 1:
            raise ValueError(f"max length {max_length} leaves no room for a text beside the prompt "
                             f"({len(self.head) + len(suffix)} tokens)")
        ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=room)["input_ids"]
        return [[*self.head, *text, *suffix] for text in ids]

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The mean of each row's last k real states (the prompt's special tokens), under either padding."""
        last = attention_mask.shape[1] - 1 - attention_mask.flip(1).int().argmax(dim=1, keepdim=True)
        rows = last - self.k + 1 + torch.arange(self.k, device=hidden.device)
        return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1])).mean(dim=1)
