"""Qwen2 and Qwen2.5 (Yang et al. 2024): Llama's layer with biases on the query, key and value projections; the
backbone of gte-Qwen2; as an encoder (backbones/causal_lm.py). A new model attends to its whole text."""

from transformers import Qwen2Config, Qwen2Model

from pretrieve.models.backbones.causal_lm import CausalLMBackbone


class Qwen2Backbone(CausalLMBackbone):
    name = model_type = "qwen2"
    display_name = "Qwen2"
    model_class, config_class = Qwen2Model, Qwen2Config
    config_kwargs = {"use_sliding_window": False}
