"""The encoder families every head runs on (base.py says what a backbone provides), by `model.backbone`."""

from pretrieve.models.backbones.base import Backbone
from pretrieve.models.backbones.registry import (BACKBONES, DECODER_LLMS, ENCODER_FAMILIES, UNPADDING, backbone_named,
                                                 backbone_of)

__all__ = ["BACKBONES", "DECODER_LLMS", "ENCODER_FAMILIES", "UNPADDING", "Backbone", "backbone_named", "backbone_of"]
