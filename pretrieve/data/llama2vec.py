"""Llama2Vec's batches (Li et al., ACL 2024; models/heads/llama2vec.py): each text followed by the prompts whose
special tokens hold its embedding, and the bags of words those embeddings must predict.

A row, right-padded:

    <bos> " text ", summarize the above passage within eight words: S1..S8 ", predict the following ... P1..P8
    |------ segment 0 (text) -------|------- segment 1 (EBAE) ---------------|------- segment 2 (EBAR) -------|
    positions 0 .. T-1              | T .. T+S-1                             | T .. T+P-1 (EBAE's again)

EBAE's targets are the text's own words as the row holds it (LLARA's reach past the input's cut:
docs/methods.md), EBAR's those of the text that follows it: the block is cut at the word start nearest its
middle, the first half is the text, the second its "next passage" (LLARA reads the two from a prepared file).
Both bags hold each token once and leave out stop words, punctuation and special tokens: LLARA removes NLTK's
English stop words and punctuation word by word before tokenising; pretrieve drops the same kinds of token, each
judged by the text it decodes to (data/spans.py's list and rule). `ebae` or `ebar` alone appends its own prompt
only, with ordinary positions.

The prompts' special tokens are the tokenizer's reserved ones: `<|reserved_special_token_0..15|>` of
`pretrieve tokenizer train --kind llm`, else BERT's `[unused0..15]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from pretrieve.data.collators import POSITIONS, TARGETS, labelled_positions
from pretrieve.data.masking import Vocabulary
from pretrieve.data.spans import word_candidates

TEXT, SUMMARY, PREDICT, PAD = 0, 1, 2, -1  # `segments`
TASKS = ("ebae", "ebar", "both")
RESERVED_NAMES = ("<|reserved_special_token_{}|>", "[unused{}]")


def reserved_tokens(vocab: Vocabulary, count: int) -> list[int]:
    """The ids of the first `count` reserved tokens of the vocabulary (either naming), or a ValueError."""
    index = {token: i for i, token in enumerate(vocab.tokens)}
    for name in RESERVED_NAMES:
        ids = [index.get(name.format(i)) for i in range(count)]
        if None not in ids:
            return ids
    names = " or ".join(name.format("i") for name in RESERVED_NAMES)
    raise ValueError(f"the tokenizer has no {count} reserved tokens ({names}) for Llama2Vec's prompts: train one "
                     "with `pretrieve tokenizer train --kind llm` and set data.tokenizer")


@dataclass
class Llama2VecCollator:
    """`input_ids`, `attention_mask`, `position_ids`, `segments` [B, L]; `mlm_labels` [B, L] (the text's ids at
    its positions: the next-token loss); per task its `<task>_slots` [B, k] (positions of its special tokens)
    and `<task>_targets` [B, T] (its bag of token ids, -1 padded)."""

    vocab: Vocabulary
    max_len: int = 128
    tasks: str = "both"
    prompt_tokens: int = 8
    summary_prompt: str = '", summarize the above passage within eight words: '
    predict_prompt: str = '", predict the following passage within eight words: '
    seed: int = 0
    pad_to_multiple_of: int = 8
    data_kind: ClassVar[str] = "text"
    suffixes: dict = field(init=False, repr=False)  # task -> its prompt's words and special tokens (ids)

    @classmethod
    def from_options(cls, options, vocab: Vocabulary, seed: int = 0):
        return cls(vocab=vocab, seed=seed, **{name: getattr(options, name) for name in (
            "max_len", "tasks", "prompt_tokens", "summary_prompt", "predict_prompt")})

    def __post_init__(self):
        if self.tasks not in TASKS:
            raise ValueError(f"method.tasks: {self.tasks!r} is not one of {', '.join(TASKS)}")
        k = self.prompt_tokens
        reserved = reserved_tokens(self.vocab, 2 * k)
        self.prefix = self.vocab.encode('"')
        self.suffixes = {}
        for task, prompt, specials in (("ebae", self.summary_prompt, reserved[:k]),
                                       ("ebar", self.predict_prompt, reserved[k:])):
            if self.tasks in (task, "both"):
                words = self.vocab.encode(prompt)
                self.suffixes[task] = np.array(words + specials, dtype=np.int64)
        self.room = self.max_len - 1 - len(self.prefix) - sum(len(s) for s in self.suffixes.values())
        if self.room < 2:
            raise ValueError(f"method.max_len: {self.max_len} leaves no room for a text beside the prompts "
                             f"({self.max_len - self.room} tokens)")
        self.candidates = word_candidates(self.vocab)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        texts, nexts = zip(*(self.split(np.asarray(s["ids"], dtype=np.int64)) for s in samples))
        pads = [bool(s.get("pad", False)) for s in samples]  # the stream's pad samples: no targets
        rows = [self.row(text) for text in texts]
        width = max(len(ids) for ids, _, _ in rows)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        out = {name: np.full((len(rows), width), fill, dtype=np.int64) for name, fill in (
            ("input_ids", self.vocab.pad_id), ("attention_mask", 0), ("position_ids", 0), ("segments", PAD),
            ("mlm_labels", -100))}
        for b, (ids, segments, positions) in enumerate(rows):
            n = len(ids)
            out["input_ids"][b, :n], out["attention_mask"][b, :n] = ids, 1
            out["segments"][b, :n], out["position_ids"][b, :n] = segments, positions
            text = np.arange(1 + len(self.prefix), 1 + len(self.prefix) + len(texts[b]))
            if not pads[b]:  # predicted from the state before each (heads/llama2vec.py)
                out["mlm_labels"][b, text] = ids[text]
        k = self.prompt_tokens
        for task, targets in (("ebae", texts), ("ebar", nexts)):
            if task in self.suffixes:
                segment = SUMMARY if task == "ebae" else PREDICT
                out[f"{task}_slots"] = np.stack([np.flatnonzero(out["segments"][b] == segment)[-k:]
                                                 for b in range(len(rows))])
                out[f"{task}_targets"] = self.bags([t[:0] if pad else t for t, pad in zip(targets, pads)])
        positions = labelled_positions(out["mlm_labels"])  # the LM loss's, gathered with no wait (token_targets)
        out["mlm_labels" + POSITIONS], out["mlm_labels" + TARGETS] = positions
        return {name: torch.from_numpy(value) for name, value in out.items()}

    def split(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the text, what follows it): with EBAR, the block is cut at the word start nearest its middle."""
        if "ebar" not in self.suffixes:
            return block[:self.room], block[:0]
        starts = np.flatnonzero(~self.vocab.continuation[block])
        starts = starts[(starts > 0) & (starts < len(block))]
        cut = int(starts[np.argmin(np.abs(starts - len(block) / 2))]) if len(starts) else len(block) // 2
        return block[:cut][:self.room], block[cut:]

    def row(self, text: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, segments, positions) of one text and its prompts; EBAR's prompt reuses EBAE's positions."""
        head = np.concatenate([[self.vocab.cls_id], self.prefix, text]).astype(np.int64)
        ids, segments, positions = [head], [np.full(len(head), TEXT)], [np.arange(len(head))]
        for task, suffix in self.suffixes.items():
            ids.append(suffix)
            segments.append(np.full(len(suffix), SUMMARY if task == "ebae" else PREDICT))
            positions.append(np.arange(len(head), len(head) + len(suffix)))
        return np.concatenate(ids), np.concatenate(segments), np.concatenate(positions)

    def bags(self, texts) -> np.ndarray:
        """[B, T] each text's distinct content tokens (no stop word, punctuation or special token), -1 padded."""
        bags = [np.unique(t[self.candidates[t]]) for t in texts]
        out = np.full((len(bags), max(1, max(len(b) for b in bags))), -1, dtype=np.int64)
        for b, bag in enumerate(bags):
            out[b, :len(bag)] = bag
        return out
