"""A decoder LLM's model class as pretrieve trains it, for loaders outside pretrieve.

Plain HF classes would encode two kinds of export otherwise than they were trained:
- a decoder LLM made bidirectional (`model.bidirectional: true`, LLM2Vec / MNTP): HF's class attends causally;
- an export whose LoRA adapter was kept apart (`adapter/`, models/lora.py): HF's class reads the frozen base.
Such an export carries a copy of this file as `pretrieve_model.py`, named in its config.json's `auto_map`, so
that `SentenceTransformer(path, trust_remote_code=True)` and `AutoModel.from_pretrained(path,
trust_remote_code=True)` encode as pretrieve does. The copy needs torch and transformers only (and peft for an
adapter), not pretrieve. pretrieve's own loaders use this module from the package (`hf_model_class`): they run
no code from a model directory. Positions count from each text's first real token, as in training, so left and
right padding give a text the same states.
"""

from __future__ import annotations

import os
from functools import partial

import torch
import transformers
from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask

BASE_MODEL = "LlamaModel"  # the family's HF base model class; the copy in an export names its own
ADAPTER_DIR = "adapter"  # a LoRA adapter kept apart, folded in at load (peft)
CODE_FILE = "pretrieve_model.py"
CLASS_NAME = "PretrieveModel"


def encoder_forward(model, causal, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                    **kwargs):
    """`model`'s (an HF decoder base model's) outputs, causal or bidirectional as its config says, at positions
    from each text's first real token; `causal(**inputs)` runs the family's own forward (`model` itself, so that
    hooks on it run, or its class's forward)."""
    if attention_mask is not None and position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if not getattr(model.config, "bidirectional", False):
        return causal(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      inputs_embeds=inputs_embeds, **kwargs)
    if inputs_embeds is None:
        inputs_embeds = model.get_input_embeddings()(input_ids)
    if attention_mask is None:
        attention_mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
    build = create_bidirectional_sliding_window_mask if getattr(model.config, "sliding_window", None) \
        else create_bidirectional_mask
    # a prepared [B, 1, L, L] mask that still hides padding: the families' own mask functions pass it through
    mask = build(model.config, inputs_embeds, attention_mask, allow_is_bidirectional_skip=False)
    return causal(inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=position_ids, is_causal=False,
                  **kwargs)


def hf_model_class(base: type) -> type:
    """`base` (an HF decoder base model class) with pretrieve's forward and an adapter kept apart folded in."""

    class PretrieveModel(base):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
            return encoder_forward(self, partial(base.forward, self), input_ids, attention_mask, position_ids,
                                   inputs_embeds, **kwargs)

        @classmethod
        def from_pretrained(cls, path, *args, **kwargs):
            model = super().from_pretrained(path, *args, **kwargs)
            adapter = os.path.join(str(path), ADAPTER_DIR)
            if os.path.isfile(os.path.join(adapter, "adapter_config.json")):
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
            return model

    PretrieveModel.__name__ = PretrieveModel.__qualname__ = f"Pretrieve{base.__name__}"
    return PretrieveModel


PretrieveModel = hf_model_class(getattr(transformers, BASE_MODEL))
