"""The backbones by name and by a config's model type (`model.backbone`, `init_from`'s config.json)."""

from __future__ import annotations

from pretrieve.models.backbones.base import Backbone
from pretrieve.models.backbones.bert import BertBackbone
from pretrieve.models.backbones.llama import LlamaBackbone
from pretrieve.models.backbones.mistral import MistralBackbone
from pretrieve.models.backbones.modernbert import ModernBertBackbone
from pretrieve.models.backbones.qwen2 import Qwen2Backbone
from pretrieve.models.backbones.qwen3 import Qwen3Backbone
from pretrieve.models.backbones.roberta import RobertaBackbone, XLMRobertaBackbone

BACKBONES: dict[str, type[Backbone]] = {b.name: b for b in (BertBackbone, RobertaBackbone, XLMRobertaBackbone,
                                                            ModernBertBackbone, LlamaBackbone, Qwen2Backbone,
                                                            Qwen3Backbone, MistralBackbone)}
# for messages
ENCODER_FAMILIES = ", ".join(name for name, backbone in BACKBONES.items() if not backbone.causal)
DECODER_LLMS = ", ".join(name for name, backbone in BACKBONES.items() if backbone.causal)
UNPADDING = ", ".join(name for name, backbone in BACKBONES.items() if backbone.unpads)  # model.unpad


def backbone_named(name: str) -> type[Backbone]:
    if name not in BACKBONES:
        raise ValueError(f"model.backbone: {name!r} is not one of {', '.join(BACKBONES)}")
    return BACKBONES[name]


def backbone_of(config) -> type[Backbone]:
    """The backbone of a HF config (its model_type, as config.json records it)."""
    for backbone in BACKBONES.values():
        if backbone.model_type == config.model_type:
            return backbone
    raise ValueError(f"model type {config.model_type!r} has no backbone here (known: "
                     f"{', '.join(b.model_type for b in BACKBONES.values())})")
