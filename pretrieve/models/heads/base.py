"""What every pre-training head shares: the encoder, the loss dict, and its extra weights for export."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from pretrieve.models.encoder import HEAD_WEIGHTS, MODEL_PREFIX, TOKEN_HEAD, Encoder, export_meta, read_weights

log = logging.getLogger(__name__)
ENCODER_MODEL = "encoder." + MODEL_PREFIX  # the exported base model's keys in a head's state dict


class PretrainingHead(nn.Module):
    """`forward(batch) -> {"loss": total, "<part>": detached component, ...}` over one shared encoder."""

    # on a decoder LLM family (backbones/causal_lm.py): None, refused (the auto-encoding heads need an encoder
    # family's decoder layer); "bidirectional", with model.bidirectional only; "any", causal attention too;
    # "causal", causal decoder LLMs only (encoder families refused too)
    decoder_llms: str | None = None
    predicts_tokens = True  # computes a loss over the vocabulary (model.vocab_loss says how)

    def __init__(self, encoder: Encoder, options):
        super().__init__()
        self.encoder = encoder
        self.options = options

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def resolved_options(self):
        """The options as this head runs them: a default left to the model (None) filled in with the value used,
        for what a run logs (MLflow params)."""
        return self.options

    def set_step(self, step: int, max_steps: int) -> None:
        """The optimizer step (0-based) of `max_steps` that the next forwards compute, told by the training loop
        before each micro-batch: a head whose loss weights follow a schedule over training reads it."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Every weight that is not the exported base model: MLM head, decoders, projections."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith(ENCODER_MODEL)}

    def load_extra_weights(self, path: str | Path, method: str) -> list[str]:
        """Load the head weights saved beside an export (continue pre-training); returns what was missing. From
        an export of another method (contrastive pre-training after RetroMAE, say), the weights the two heads
        share load, the rest of this head starts fresh and the other's are left: said in one line, not warned."""
        state = read_weights(Path(path), HEAD_WEIGHTS)
        if not state:
            # the MLM / LM head comes with the encoder (Encoder.from_pretrained, which reports it)
            missing = [k for k in self.extra_state() if not k.startswith(tuple(f"encoder.{n}" for n in TOKEN_HEAD))]
            if missing:
                log.warning("init_from %s: no %s, head weights initialised: %s", path, HEAD_WEIGHTS, ", ".join(missing))
            return missing
        result = self.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.startswith(ENCODER_MODEL)]
        if missing or result.unexpected_keys:
            trained_by = export_meta(path).get("method")
            if trained_by is not None and trained_by != method:
                log.info("init_from %s (a %s export): head weights initialised %s, not used %s", path, trained_by,
                         missing, result.unexpected_keys)
            else:
                log.warning("init_from %s: head weights missing %s, unexpected %s", path, missing,
                            result.unexpected_keys)
        return missing

