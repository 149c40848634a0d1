"""Decoder LLM families (Llama, Qwen2, Qwen3, Mistral) as encoders: the HF base model (no LM head), whose last hidden
states a head pools, e.g. at the last token (models/dense_pooling.py).

- Attention is causal, as the family was pre-trained. `model.bidirectional: true` (LLM2Vec, BehnamGhader et al.
  2024, §2) lets every token attend to every real token of its text: the layers get a bidirectional mask that
  still hides padding, recorded in the HF config (`bidirectional`) so that an export keeps it.
- Positions are rotary and count from each text's first real token, so right and left padding give a text the
  same position ids, and the same states up to rounding.
- The token predictions some heads make (Llama2Vec's, MNTP's) go through the checkpoint's own LM head, with no
  transform and no bias, as its *ForCausalLM computes them: the word embeddings where the config ties them (new
  models here, the small Qwen3 ones), else the untied `lm_head.weight` (LLaMA-2-7B, Mistral-7B, Qwen3 >= 4B),
  which init_from reads and the encoder keeps beside the base model (`Encoder.lm_head`, exported with the head's
  weights).
- The auto-encoding heads' decoder layer (RetroMAE, DupMAE, ...) is not defined for these families: those heads
  refuse them when the config is read (PretrainingHead.decoder_llms).
"""

from __future__ import annotations

import torch
from torch import nn
from pretrieve.models.backbones.base import Backbone
from pretrieve.models.hf_model_code import encoder_forward


class CausalLMBackbone(Backbone):
    causal = True
    feed_forward_modules = ("post_attention_layernorm", "mlp")
    ffn_matrices = 3  # SwiGLU: gate and up (h x f), down (f x h)
    ffn_activations = 4  # gate and up projections, SiLU(gate), and its product with up (the down projection's input)
    hf_mlm_keys = {"lm_head.": "lm_head."}  # a *ForCausalLM's untied LM head (a tied one is not saved)
    mlm_bias = False  # an LM head has no bias
    default_pad_token_id = 0  # these families define none; the training tokenizer's pad id is used
    config_kwargs: dict = {}  # the family's own settings of a new model's HF config

    @classmethod
    def config(cls, options, pad_token_id: int):
        return cls.config_class(
            vocab_size=options.vocab_size, hidden_size=options.hidden_size, num_hidden_layers=options.num_layers,
            num_attention_heads=options.num_heads, num_key_value_heads=options.num_heads,
            head_dim=options.hidden_size // options.num_heads, intermediate_size=options.intermediate_size,
            max_position_embeddings=options.max_position_embeddings, attention_dropout=options.dropout,
            pad_token_id=pad_token_id, bos_token_id=None, eos_token_id=None, tie_word_embeddings=True,
            bidirectional=options.bidirectional, **cls.config_kwargs)

    @staticmethod
    def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # the same forward as an export's own model class (models/hf_model_code.py), which loaders outside
        # pretrieve run
        return encoder_forward(model, model, input_ids, attention_mask).last_hidden_state

    @staticmethod
    def masked_forward(model, input_ids: torch.Tensor, visible: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """Last hidden states under a mask of the head's own, `visible` [B, L, L] (True: row i attends to key j),
        at position ids `positions` [B, L] (Llama2Vec's prompts: heads/llama2vec.py)."""
        kind = model.config._attn_implementation
        if kind not in ("sdpa", "eager"):
            raise ValueError(f"attention {kind!r} takes no arbitrary mask: use sdpa or eager")
        embeds = model.get_input_embeddings()(input_ids)
        mask = visible[:, None]
        if kind == "eager":  # added to the scores
            mask = torch.zeros(mask.shape, dtype=embeds.dtype, device=embeds.device).masked_fill(
                ~mask, torch.finfo(embeds.dtype).min)
        return model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                     is_causal=False).last_hidden_state

    @staticmethod
    def mlm_transform(config) -> nn.Module:
        return nn.Identity()

    @staticmethod
    def output_projection(config) -> nn.Module | None:
        """The *ForCausalLM's `lm_head` where the config unties it from the word embeddings; None where tied."""
        if getattr(config, "tie_word_embeddings", True):
            return None
        return nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def extend_positions(cls, model, positions: int) -> None:
        """Rotary positions have no table: the config's length is all there is to raise."""
        model.config.max_position_embeddings = max(positions, model.config.max_position_embeddings)

    @classmethod
    def decoder_layer(cls, config) -> nn.Module:
        raise ValueError(f"model.backbone: {cls.name} has no decoder layer for the auto-encoding heads")

    @staticmethod
    def decoder_norm(config) -> nn.Module:
        raise ValueError("model.backbone: decoder LLM families have no decoder for the auto-encoding heads")

    @staticmethod
    def init_new(model, module: nn.Module) -> None:
        """The family's own initialisation (normal(0, initializer_range), RMSNorm weights 1)."""
        for m in module.modules():
            model._init_weights(m)
