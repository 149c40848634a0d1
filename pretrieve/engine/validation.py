"""Held-out loss during pre-training (`data.validation`, `train.eval_every`).

A fixed set of validation batches is collated once, at the start, from the validation manifests (shards from
`pretrieve prepare` that training never reads): stream order and masks come from VALIDATION_SEED, not from the
run's seed, so runs of every seed, size and method of a study are scored on the same texts with the same
masks. Every `eval_every` steps and at the last step the head's loss and each loss part are averaged over
these batches, in eval mode (no dropout) and without gradients, then over ranks; the record
{"step", "val_loss", "val_<part>"...} goes to metrics.jsonl and MLflow. Evaluation draws no random numbers,
so training goes on exactly as without it, and a resumed run logs the numbers an uninterrupted one logs.
"""

from __future__ import annotations

from itertools import islice

import torch

VALIDATION_SEED = 0  # the same validation batches for every run, whatever its seed


class Validation:
    def __init__(self, batches: list[dict]):
        self.batches = batches

    @classmethod
    def build(cls, manifests: list[str], collate, batch_size: int, num_batches: int, read=None,
              tokenizer=None) -> "Validation":
        """This rank's share of the first `num_batches` x world batches of the validation stream (`read`:
        data.remote.ReadOptions for manifests at URLs; `tokenizer`: the training tokenizer the shards must match,
        as ShardStream takes it)."""
        from pretrieve.data.stream import ShardStream, StreamLoader

        stream = ShardStream(manifests, seed=VALIDATION_SEED, shuffle_buffer=1, read=read, tokenizer=tokenizer)
        loader = StreamLoader(stream, batch_size=batch_size, collate_fn=collate,
                              generator=torch.Generator().manual_seed(VALIDATION_SEED))
        return cls(list(islice(loader, num_batches)))

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """{"val_loss": .., "val_<part>": ..}: each part's mean over this rank's batches, averaged over ranks."""
        import torch.distributed as dist

        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        try:
            with torch.no_grad():
                for batch in self.batches:
                    out = model({k: v.to(device) for k, v in batch.items()})
                    for name, value in out.items():
                        sums[name] = sums.get(name, 0.0) + float(value)
        finally:
            model.train(was_training)
        names = sorted(sums)  # every rank runs the same head: the same parts
        totals = torch.tensor([*(sums[n] for n in names), len(self.batches)], dtype=torch.float64,
                              device=device)  # NCCL reduces device tensors only
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        *values, count = totals.tolist()
        return {f"val_{name}": value / max(count, 1) for name, value in zip(names, values)}
