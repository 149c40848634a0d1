"""One training step of the contrastive head under DeepSpeed, with GradCache and without, on this process's rank
(run directly for one rank, under torchrun for several): prints one JSON line per variant with the largest
differences between the two runs' losses and updated weights (plain SGD, lr 1: the update is the gradient).

Usage: grad_cache_step.py VARIANTS OUT   (VARIANTS: stage:dropout:checkpointing:accumulation[:matryoshka],
comma-separated; matryoshka 1: the loss summed over the prefixes MATRYOSHKA_DIMS; each rank writes its lines to
OUT/rank<N>.jsonl)
"""

import json
import os
import sys

import numpy as np
import torch

for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)
if "MASTER_PORT" not in os.environ:
    from pretrieve.engine.world import free_loopback_port

    os.environ["MASTER_PORT"] = str(free_loopback_port())
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pretrieve.data.masking import Vocabulary  # noqa: E402
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend  # noqa: E402
from pretrieve.engine.ops import environment_ops  # noqa: E402
from pretrieve.engine.preemption import prebuild_ops  # noqa: E402
from pretrieve.models.encoder import ModelOptions  # noqa: E402
from pretrieve.models.heads import get_method  # noqa: E402
from pretrieve.models.heads.contrastive import ContrastiveCollator  # noqa: E402

PAIRS, CHUNK = 6, 4  # per rank and micro-batch: 6 pairs of 2 negatives each, encoded 4 texts at a time
MATRYOSHKA_DIMS = [32, 16, 8]


def samples(rank: int, micro: int) -> list[dict]:
    rng = np.random.default_rng([rank, micro])
    ids = lambda: rng.integers(2000, 9000, size=int(rng.integers(3, 14)))  # noqa: E731
    return [{"query": ids(), "pos": ids(), "negs": [ids(), ids()], "source": "t", "doc": f"{rank}-{micro}-{i}",
             "index": i} for i in range(PAIRS)]


def weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = [p for p in engine.module.parameters()]
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def step(stage: int, dropout: bool, checkpointing: bool, accumulation: int, matryoshka: bool, chunk: int | None,
         cache: bool):
    import deepspeed

    method = get_method("contrastive")
    options = method.options_from({"negatives": 2, "symmetric": True, "learn_temperature": True, "max_len": 16,
                                   "query_max_len": 16, "matryoshka_dims": MATRYOSHKA_DIMS if matryoshka else None})
    model = ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                         dropout=0.1 if dropout else 0.0, pad_token_id=0)
    head = method.build(options, model, seed=0)
    head.chunk, head.grad_cache = chunk, cache
    if checkpointing:
        head.encoder.enable_activation_checkpointing()
    optimizer = torch.optim.SGD([p for p in head.parameters() if p.requires_grad], lr=1.0)
    config = {"train_micro_batch_size_per_gpu": PAIRS, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}
    with environment_ops():  # the venv's extension cache, a stale build lock cleared, as the engine starts
        prebuild_ops(config)
        engine, _, _, _ = deepspeed.initialize(model=head, optimizer=optimizer, config=config)
    before = weights(engine)
    collate = ContrastiveCollator(Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)), max_len=16,
                                  query_max_len=16, negatives=2)
    engine.train()
    torch.manual_seed(7)
    losses, accuracy = [], []
    for micro in range(accumulation):
        out = engine(collate(samples(engine.global_rank, micro)))
        engine.backward(out["loss"])
        engine.step()
        losses.append(out["loss"].item())
        accuracy.append(out["accuracy"].item())
    after = weights(engine)
    engine.destroy()
    return losses, {n: before[n] - after[n] for n in before}, accuracy


def main():
    from pretrieve.engine.world import unlink_cpu_allreduce_buffer

    for variant in sys.argv[1].split(","):
        stage, dropout, checkpointing, accumulation, matryoshka = (int(x) for x in (variant + ":0").split(":")[:5])
        args = (stage, bool(dropout), bool(checkpointing), accumulation, bool(matryoshka))
        cached = step(*args, CHUNK, True)
        # with dropout, the reference is the same chunks under one graph (the masks are drawn per chunk); without,
        # the whole micro-batch in one encoder call per text kind
        reference = step(*args, CHUNK, False) if dropout else step(*args, None, True)
        unlink_cpu_allreduce_buffer()
        updates = cached[1]
        diff = {n: float((updates[n] - reference[1][n]).abs().max()) for n in updates}
        size = {n: float(reference[1][n].abs().max()) for n in updates}
        with open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.jsonl"), "a") as out:
            out.write(json.dumps({"variant": variant, "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                                  "loss": cached[0], "reference_loss": reference[0], "accuracy": cached[2],
                                  "worst": max(diff, key=lambda n: diff[n] / (size[n] + 1e-6)),
                                  "diff": diff, "size": size}) + "\n")


if __name__ == "__main__":
    main()
