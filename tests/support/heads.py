"""Method heads built, stepped and exported in the test process, on the tiny configurations."""
from pathlib import Path

from .paths import TINY_CONFIGS


def exported_after_a_step(head, batch: dict, folder: Path) -> dict:
    """One AdamW step of `head` on `batch`, then its export to `folder`: the export loads in transformers'
    AutoModel as the encoder (the same hidden states), and as a head again with every weight equal; returns the
    reloaded head's state dict (for the method's own keys)."""
    import torch
    from transformers import AutoModel

    from pretrieve.models.export import export, load_export

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    head(batch)["loss"].backward()
    optimizer.step()
    out = export(head.eval(), folder)
    hf = AutoModel.from_pretrained(str(out), local_files_only=True).eval()
    with torch.no_grad():
        ours = head.encoder(batch["input_ids"], batch["attention_mask"])
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(theirs[real], ours[real], rtol=1e-5, atol=1e-5)
    again = load_export(out).state_dict()
    assert all(torch.equal(again[k], v) for k, v in head.state_dict().items())
    return again


def tiny_head(method: str, *overrides: str):
    """(method, options, head) of configs/pretrain/tiny-`method`.yaml with `overrides`, dropout off, seed 0."""
    from pretrieve.config import load_config
    from pretrieve.pretrain_config import method_options, model_options

    config = load_config(TINY_CONFIGS / f"tiny-{method}.yaml", ["model.dropout=0.0", *overrides])
    spec, options = method_options(config)
    return spec, options, spec.build(options, model_options(config), seed=0)


def collated_with_a_pad_sample(method, options, vocab, samples: list[dict]):
    """(batch, the unmasked ids [B, L]) of `method`'s collator over the first 64 `samples`, the last of them made a
    stream pad sample (no targets)."""
    import torch

    collate = method.collator.from_options(options, vocab, seed=0)
    samples = [*samples[:63], {**samples[63], "pad": True}]
    return collate(samples), torch.from_numpy(collate.pad(samples).ids)


def text_methods(methods) -> list[str]:
    """The names of `methods` (registered ones) that train an encoder family on blocks of text, sorted: the
    contrastive method's batches are pairs (tests/test_contrastive.py, tests/test_grad_cache.py), Llama2Vec's
    heads adapt decoder LLMs only (tests/test_llama2vec.py)."""
    return sorted(name for name, method in methods.items()
                  if method.collator.data_kind == "text" and method.head.decoder_llms != "causal")


# how pretrieve named the decoder layers' parameters before the backbone interface (decoder.py's load hook)
OLD_DECODER_NAMES = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
                     "attention.output.dense": "attention_output", "attention.output.LayerNorm": "attention_norm",
                     "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm"}


def old_parameter_name(name: str, method: str) -> str:
    """`name` as pretrieve wrote it before the backbone interface: the base model under `encoder.bert.`, the
    decoder layers' parameters by their short names, and RetroMAE's one layer as the decoder itself."""
    name = name.replace("encoder.model.", "encoder.bert.")
    if name.startswith("decoder."):
        for new, short in OLD_DECODER_NAMES.items():
            name = name.replace(f".{new}.", f".{short}.")
        if method == "retromae":
            name = name.replace("decoder.layers.0.", "decoder.")
    return name


def adamw_steps(head, batch: dict, steps: int, lr: float) -> list[float]:
    """The losses of `steps` AdamW steps of `head` on one fixed batch; after the first backward, every trainable
    weight has a gradient (the loss reaches it) or the list of those without one fails the test."""
    import torch

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = head(batch)["loss"]
        loss.backward()
        if not losses:
            missing = [n for n, p in head.named_parameters() if p.requires_grad and p.grad is None]
            assert not missing, missing
        optimizer.step()
        losses.append(loss.item())
    return losses
