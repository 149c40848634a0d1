"""The encoder families every head runs on (base.py says what a backbone provides), by `model.backbone`."""

from pretrieve.models.backbones.base import Backbone
from pretrieve.models.backbones.registry import BACKBONES, backbone_named, backbone_of

__all__ = ["BACKBONES", "Backbone", "backbone_named", "backbone_of"]
