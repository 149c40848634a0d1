"""Mistral (Jiang et al. 2023): Llama's layer, with sliding-window attention in its first release (7B v0.1);
the backbone of E5-Mistral; as an encoder (backbones/causal_lm.py). A new model attends to its whole text."""

from transformers import MistralConfig, MistralModel

from pretrieve.models.backbones.causal_lm import CausalLMBackbone


class MistralBackbone(CausalLMBackbone):
    name = model_type = "mistral"
    display_name = "Mistral"
    model_class, config_class = MistralModel, MistralConfig
    config_kwargs = {"sliding_window": None}
