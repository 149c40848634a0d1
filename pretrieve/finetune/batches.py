"""Batches of fine-tuning groups: each query with one positive and `negatives` negatives, tokenized.

`GroupLoader` walks the examples epoch by epoch in a permutation seeded by (seed, epoch). Rank r of a world
of W takes micro-batch r of every W consecutive ones, so the ranks see disjoint queries and a global batch is
the same at any world size. Its position (epoch, examples taken by all ranks) is what a checkpoint saves: a
resumed run continues with the next batch, also at another world size (a universal checkpoint) when the
global batch is unchanged. Positive and negative choices are seeded by (seed, epoch, example), so
they do not depend on the order of iteration either. The last incomplete global batch of an epoch is dropped.

Batch keys: query_input_ids / query_attention_mask [B, Lq], passage_input_ids / passage_attention_mask
[B x G, Lp] (G = 1 + negatives: the positive first, then the negatives of the same query), and with teacher
scores teacher_scores [B, G].

Prompts (`finetune.query_prompt` / `passage_prompt`) are put before the texts. `query_max_len` counts the
query's own tokens: a query is cut at query_max_len plus its prompt's tokens, so an instruction longer than
query_max_len does not crowd the query out (every query the same prompt, the loss at log(group)).
`passage_max_len` is the model's maximum length, which sentence-transformers and `pretrieve eval` apply to the
prompt and the text together: a passage prompt that leaves no room is refused by the config's checks
(finetune/run.py).
"""

from __future__ import annotations

import random

import torch

from pretrieve.finetune.examples import Example


class GroupLoader:
    def __init__(self, examples: list[Example], tokenizer, batch_size: int, negatives: int, query_max_len: int,
                 passage_max_len: int, seed: int, rank: int = 0, world: int = 1, teacher_scores: bool = False,
                 prompts: tuple[str, str] = ("", "")):
        if negatives > 0:
            for example in examples:
                if not example.neg:
                    raise ValueError(f"{example.where}: no negatives, but finetune.negatives is {negatives} "
                                     "(mine some with `pretrieve mine`, or set finetune.negatives=0: in-batch only)")
        if teacher_scores:
            for example in examples:
                if example.pos_scores is None:
                    raise ValueError(f"{example.where}: no pos_scores / neg_scores; distillation needs teacher "
                                     "scores (`pretrieve teacher-scores`)")
        self.batches_per_epoch = len(examples) // (batch_size * world)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(examples)} examples make no global batch of {batch_size} x {world} ranks")
        self.examples, self.tokenizer = examples, tokenizer
        self.batch_size, self.negatives, self.seed, self.rank, self.world = batch_size, negatives, seed, rank, world
        self.query_max_len, self.passage_max_len, self.teacher_scores = query_max_len, passage_max_len, teacher_scores
        self.epoch, self.taken = 0, 0
        self.last_batch: tuple[int, list[int]] | None = None  # (epoch, example rows) of the batch just yielded
        self.query_prompt, self.passage_prompt = prompts  # put before each query / passage (finetune options)
        # a query's tokens: query_max_len of its own after the prompt's (the module docstring)
        self.query_length = query_max_len + prompt_tokens(tokenizer, self.query_prompt)

    def state_dict(self) -> dict:
        """The epoch and the examples of it every rank together has taken: valid at any world size."""
        return {"epoch": self.epoch, "examples": self.taken * self.world * self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.taken = int(state["epoch"]), int(state["examples"]) // (self.world * self.batch_size)

    def describe_position(self) -> str:
        per_epoch = self.batches_per_epoch * self.world * self.batch_size
        return f"epoch {self.epoch}, {self.state_dict()['examples']} of its {per_epoch} examples read"

    def describe_batch(self, origin: tuple[int, list[int]]) -> str:
        """The examples (file:line) of the batch `origin` (last_batch) names, for a health alarm."""
        epoch, rows = origin
        return f"examples {', '.join(self.examples[row].where or str(row) for row in rows)} (epoch {epoch})"

    def __iter__(self):
        """The rest of the current epoch (the next one when it is used up)."""
        if self.taken >= self.batches_per_epoch:
            self.epoch, self.taken = self.epoch + 1, 0
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        while self.taken < self.batches_per_epoch:
            start = (self.taken * self.world + self.rank) * self.batch_size
            rows = order[start:start + self.batch_size]
            self.taken += 1  # before the yield: a checkpoint taken after this batch resumes at the next one
            self.last_batch = (self.epoch, rows)
            yield self.collate(rows)

    def group(self, row: int) -> tuple[str, list[str], list[float] | None]:
        """(query, [positive, negatives...], teacher scores of those) of example `row` in this epoch."""
        example = self.examples[row]
        rng = random.Random(f"{self.seed}/{self.epoch}/{row}")
        pos = rng.randrange(len(example.pos))
        if self.negatives <= len(example.neg):
            negs = rng.sample(range(len(example.neg)), self.negatives)
        else:  # fewer than asked for: repeat some (every query keeps the same group size)
            negs = [rng.randrange(len(example.neg)) for _ in range(self.negatives)]
        passages = [self.passage_prompt + p for p in (example.pos[pos], *(example.neg[i] for i in negs))]
        scores = None
        if self.teacher_scores:
            scores = [example.pos_scores[pos], *(example.neg_scores[i] for i in negs)]
        return self.query_prompt + example.query, passages, scores

    def collate(self, rows: list[int]) -> dict[str, torch.Tensor]:
        groups = [self.group(row) for row in rows]
        queries = self.tokenizer([g[0] for g in groups], truncation=True, max_length=self.query_length,
                                 padding=True, return_tensors="pt")
        passages = self.tokenizer([p for g in groups for p in g[1]], truncation=True,
                                  max_length=self.passage_max_len, padding=True, return_tensors="pt")
        batch = {"query_input_ids": queries["input_ids"], "query_attention_mask": queries["attention_mask"],
                 "passage_input_ids": passages["input_ids"], "passage_attention_mask": passages["attention_mask"]}
        if self.teacher_scores:
            batch["teacher_scores"] = torch.tensor([g[2] for g in groups], dtype=torch.float32)
        return batch


class PairLoader(GroupLoader):
    """Query-passage pairs for the cross-encoder teacher: `pair_input_ids` / `pair_attention_mask` /
    `pair_token_type_ids` [B x G, L] ([CLS] query [SEP] passage [SEP], the positive first in each group)."""

    def collate(self, rows: list[int]) -> dict[str, torch.Tensor]:
        groups = [self.group(row) for row in rows]
        pairs = self.tokenizer([g[0] for g in groups for _ in g[1]], [p for g in groups for p in g[1]],
                               truncation=True, max_length=self.query_length + self.passage_max_len,
                               padding=True, return_tensors="pt")
        return {"pair_input_ids": pairs["input_ids"], "pair_attention_mask": pairs["attention_mask"],
                "pair_token_type_ids": pairs["token_type_ids"]}


def prompt_tokens(tokenizer, prompt: str) -> int:
    """The tokens `prompt` takes before a text, without the tokenizer's special tokens."""
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0
