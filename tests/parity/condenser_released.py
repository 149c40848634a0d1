"""The released side of tests/parity/test_condenser_parity.py, run by the released code's venv (the standard library,
torch and transformers; luyug/Condenser's folder on PYTHONPATH):

    python condenser_released.py WORK

loads the weights and batches the test wrote to WORK into the released CondenserForPretraining and
CoCondenserForPretraining (late_mlm on, one process), computes their losses and gradients, and prints them as one
JSON line. Also runs the released coCondenser's cached (GradCache) path by hand, chunk by chunk as its trainer does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SKIP_FROM, HEAD_LAYERS, CHUNK = 2, 2, 4  # the head reads layer 2; its layers; the cached path's spans a chunk


def released_side(work: str) -> None:
    """The released code's losses and gradients for pretrieve's weights and batches."""
    import types

    import torch
    from modeling import CoCondenserForPretraining, CondenserForPretraining
    from transformers import BertConfig, BertForMaskedLM

    results = {}
    for method, cls in (("condenser", CondenserForPretraining), ("cocondenser", CoCondenserForPretraining)):
        saved = torch.load(Path(work) / f"{method}.pt")
        batch = saved["batch"]
        config = {k: v for k, v in saved["config"].items() if k not in ("architectures", "dtype", "torch_dtype")}
        rows = len(batch["input_ids"])
        model_args = types.SimpleNamespace(n_head_layers=HEAD_LAYERS, skip_from=SKIP_FROM, late_mlm=True)
        train_args = types.SimpleNamespace(per_device_train_batch_size=rows // 2 if method == "cocondenser" else rows,
                                           local_rank=-1)
        model = cls(BertForMaskedLM(BertConfig(**config)), model_args, None, train_args)
        result = model.load_state_dict(saved["state"], strict=False)
        params = dict(model.named_parameters())
        missing = [k for k in result.missing_keys if k in params and ".decoder." not in k]  # decoder: tied
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
        model.eval()
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        loss = model(dict(inputs), batch["mlm_labels"])
        loss.backward()
        worst = max((float((params[name].grad - grad).abs().max()), name) for name, grad in saved["grads"].items())
        results[method] = {"loss": loss.item(), "max_grad_diff": worst[0], "max_grad_diff_at": worst[1],
                           "params_compared": len(saved["grads"])}
        if method == "cocondenser":
            results[method]["cached_path_mlm"] = cached_mlm(model, inputs, batch["mlm_labels"])
    print(json.dumps(results))


def cached_mlm(model, inputs: dict, labels) -> dict:
    """The released trainer's GradCache step by hand (chunks of CHUNK spans, the contrastive gradient of zeros: the
    MLM terms alone): the sum of the chunks' scaled MLM losses, against the uncached MLM terms."""
    import torch

    with torch.no_grad():
        chunks = []
        for start in range(0, len(labels), CHUNK):
            part = {k: v[start:start + CHUNK] for k, v in inputs.items()}
            cache = torch.zeros(len(labels), model.lm.config.hidden_size)
            lm_loss, _ = model(part, labels[start:start + CHUNK], grad_cache=cache, chunk_offset=start)
            chunks.append(lm_loss.item())
        whole = super(type(model), model).forward(dict(inputs), labels).item()  # Condenser's terms, unscaled
    return {"chunk": CHUNK, "sum_of_chunks": sum(chunks), "uncached": whole, "ratio": sum(chunks) / whole}


if __name__ == "__main__":
    released_side(sys.argv[1])
