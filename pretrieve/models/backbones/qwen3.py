"""Qwen3 (Yang et al. 2025): Llama's layer with RMSNorm on each head's queries and keys; the backbone of the
Qwen3-Embedding models; as an encoder (backbones/causal_lm.py)."""

from transformers import Qwen3Config, Qwen3Model

from pretrieve.models.backbones.causal_lm import CausalLMBackbone


class Qwen3Backbone(CausalLMBackbone):
    name = model_type = "qwen3"
    display_name = "Qwen3"
    model_class, config_class = Qwen3Model, Qwen3Config
