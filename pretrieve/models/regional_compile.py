"""Regional compilation (`train.compile`): every encoder layer and decoder layer compiled by torch.compile on its
own, as torchtitan compiles its transformer blocks, not the whole model.

Why by layer: the layers of a stack are one module class with parameters of one shape, and torch.compile
(since 2.5) lifts a module's parameters to graph inputs, so every layer of the stack runs one compiled graph:
compile time is one layer's, not the model's. `nn.Module.compile` compiles a module's call in place, so the
module tree, the state dict's keys (no `_orig_mod.`), activation checkpointing, LoRA and what DeepSpeed's
engine wraps and hooks stay as they are; the embeddings, the heads' losses and the optimizer stay eager.

Shapes: `dynamic=True` compiles each layer's graph with symbolic batch and sequence sizes (parameters keep
static shapes: torch._dynamo.config.force_parameter_static_shapes), so batches of any length run the first
graph. A layer recompiles only for another kind of input: no mask (a batch without padding), or a packed row
(model.unpad, its batch of one). tests/test_regional_compile.py counts the compiles.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from pretrieve.models.backbones import backbone_of


def compiled_layers(module: nn.Module) -> list[nn.Module]:
    """The layers `compile_layers` compiles in `module` (a pre-training head or a fine-tuning model): each HF base
    model's stack (the backbone's `layers`) and each decoder's layers (models/heads/decoder.py)."""
    from pretrieve.models.heads.decoder import Decoder  # here: fine-tuning imports this module, not the heads

    bases = {id(m.base_model): m.base_model for m in module.modules() if isinstance(m, PreTrainedModel)}
    layers = [layer for base in bases.values() for layer in backbone_of(base.config).layers(base)]
    return layers + [layer for m in module.modules() if isinstance(m, Decoder) for layer in m.layers]


def compile_layers(module: nn.Module) -> list[nn.Module]:
    """Compile each layer of `module` in place (inductor, symbolic batch and sequence sizes); the layers."""
    layers = compiled_layers(module)
    for layer in layers:
        layer.compile(dynamic=True)
    return layers
