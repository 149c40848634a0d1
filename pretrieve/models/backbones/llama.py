"""Llama (Touvron et al. 2023): pre-norm (RMSNorm) layers, SwiGLU feed-forward blocks, rotary positions,
grouped-query attention; as an encoder (backbones/causal_lm.py)."""

from transformers import LlamaConfig, LlamaModel

from pretrieve.models.backbones.causal_lm import CausalLMBackbone


class LlamaBackbone(CausalLMBackbone):
    name = model_type = "llama"
    display_name = "Llama"
    model_class, config_class = LlamaModel, LlamaConfig
