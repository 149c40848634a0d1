"""What a pre-training head needs of an encoder family (a backbone), over HF transformers' own modules.

A backbone names the HF model and config classes, and answers, for a model of that family:
- the embedding module (`model.embeddings`: token ids or input vectors -> the first layer's input) and the
  position vectors p_i that RetroMAE's query stream adds to h (eq. 2), or None where positions are rotary;
- the stack of layers, and each layer's feed-forward block (CoT-MoTE's experts);
- the MLM head's transform and bias (its output weights are the tied word embeddings; a decoder LLM's are its
  own LM head when its config unties them) and where HF checkpoints keep them;
- the decoder layer of the auto-encoding heads: the family's own layer class, given a query stream and a
  key/value stream (called as `layer(h1, h2, attend)`), and the norm after the decoder stack (pre-norm
  families need one).
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
from torch import nn

from pretrieve.models.unpadding import padded_mask

Attend = Callable[..., torch.Tensor]  # attend(q, k, v, dropout_p) -> [B, heads, L, d] under the layer's mask


class Backbone:
    name: str  # the value of model.backbone
    display_name: str  # as papers and model cards write it
    model_type: str  # config.json's "model_type"
    model_class: type
    config_class: type
    model_kwargs: dict = {}  # model_class(config, **model_kwargs)
    default_pad_token_id: int
    # prefixes of the MLM head in the family's HF MaskedLM checkpoints -> ours (Encoder.mlm_transform / mlm_bias)
    hf_mlm_keys: dict[str, str]
    # the feed-forward block's modules in a layer: a CoT-MoTE query expert is a copy of them
    feed_forward_modules: tuple[str, ...]
    ffn_matrices: int = 2  # h x f matrices in a feed-forward block: up and down (GLU blocks: 3, with the gate)
    ffn_activations: int = 2  # f-wide tensors a feed-forward block keeps for backward: the GELU's input and output
    has_pooler: bool = False  # a [CLS] pooler in the base model (unused in pre-training, but computed)
    unpads: bool = False  # has a packed (varlen) forward: model.unpad (models/unpadding.py)
    causal: bool = False  # a decoder LLM family: causal attention unless model.bidirectional (backbones/causal_lm.py)

    @classmethod
    def config(cls, options, pad_token_id: int):
        """The HF config of a new model from the `model:` options."""
        raise NotImplementedError

    @staticmethod
    def position_offset(pad_token_id: int) -> int | None:
        """Where position 0's vector sits in the learnt position table; None: positions are rotary (no table)."""
        return None

    @staticmethod
    def layers(model) -> nn.ModuleList:
        """The stack of layers (`model.layers` in most families' HF models)."""
        return model.layers

    @staticmethod
    def position_vectors(model, width: int, device: torch.device) -> torch.Tensor | None:
        """p_0 .. p_{width-1} [width, hidden] as the embedding module adds them; None for rotary positions (the
        default: a family with a learnt table overrides it)."""
        return None

    @staticmethod
    def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, L, hidden] of the padded batch, under a mask built here on the device (HF's own
        build would read it back to check for padding: unpadding.padded_mask)."""
        mask = padded_mask(model, attention_mask, ready=True)
        return model(input_ids=input_ids, attention_mask=mask).last_hidden_state

    @staticmethod
    def packed_forward(model, input_ids: torch.Tensor, packed, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [1, T, hidden] of the texts `input_ids` [1, T], packed from the padded batch whose
        `attention_mask` is [B, L] (`packed`: unpadding.Packed)."""
        raise NotImplementedError

    @staticmethod
    def mlm_transform(config) -> nn.Module:
        raise NotImplementedError

    mlm_bias: bool = True  # the MLM head adds an output bias (BERT's); a decoder LLM's LM head has none

    @staticmethod
    def output_projection(config) -> nn.Module | None:
        """The token predictions' own output weights [vocab, hidden] (an untied LM head), or None: the word
        embeddings, tied."""
        return None

    @classmethod
    def extend_positions(cls, model, positions: int) -> None:
        """Let `model` take texts of `positions` tokens (model.extend_positions)."""
        raise NotImplementedError

    @staticmethod
    def decoder_layer(config) -> nn.Module:
        """A new decoder layer of this family: `layer(h1, h2, attend)` -> the query stream's new states."""
        raise NotImplementedError

    @staticmethod
    def decoder_norm(config) -> nn.Module:
        """Applied to the decoder's output before the MLM head (the family's final norm; post-norm: none)."""
        return nn.Identity()

    @staticmethod
    def init_new(model, module: nn.Module) -> None:
        """The family's initialisation for a module added to the model (decoders, MLM head, projections)."""
        raise NotImplementedError

    @classmethod
    def query_expert(cls, layer: nn.Module) -> nn.ModuleDict:
        """A copy of the layer's feed-forward block (the CoT-MoTE paper eq. 7: Q-FFN starts as the P-FFN)."""
        return nn.ModuleDict({name: copy.deepcopy(getattr(layer, name)) for name in cls.feed_forward_modules})

    @classmethod
    def route_feed_forward(cls, layer: nn.Module, expert: nn.ModuleDict, texts: "TextTypes") -> None:
        """Make each feed-forward module of `layer` send the passages of the batch through itself and its queries
        through its counterpart in `expert`, as `texts` says. Module by module, each on the same sequences, is
        the same as the whole block by text type (an expert is the whole block, its norm included)."""
        for name in cls.feed_forward_modules:
            module = getattr(layer, name)
            module.__class__ = _query_routed(type(module))
            module.query_route = QueryRoute(expert[name], texts)


class TextTypes:
    """Which sequences (or packed tokens) of the batch an encoder runs are queries: set by the encoder at each
    forward and kept until the next (activation checkpointing recomputes the layers in backward), read by its
    routed feed-forward modules. A plain object, as QueryRoute: a deep copy of the encoder copies it once, with
    the modules that read it."""

    def __init__(self):
        self.set(None)

    def set(self, is_query: torch.Tensor | None) -> None:
        """`is_query` bool [B] (or [1, T], packed), or None: all passages. Asked of the device once a forward, not
        once a layer."""
        self.is_query = is_query
        self.is_passage = None if is_query is None else ~is_query
        self.any = is_query is not None and bool(is_query.any())
        self.all = self.any and bool(is_query.all())


class QueryRoute:
    """What a routed feed-forward module reads: its counterpart in the layer's query expert (held, and trained,
    as `Encoder.query_experts`) and the encoder's TextTypes."""

    def __init__(self, expert: nn.Module, texts: TextTypes):
        self.expert, self.texts = expert, texts


class _QueryRouted:
    """A feed-forward module under CoT-MoTE (Backbone.route_feed_forward): the passages of the batch go through
    the module's own forward, its queries through the query expert's counterpart. The routing is the module's
    class (a subclass of its own, as torch.nn.utils.parametrize makes), so a copy of the module routes through
    the copy."""

    query_route: QueryRoute

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        to = self.query_route
        return route(to.texts, super().forward, to.expert, *inputs)


@functools.cache
def _query_routed(module_class: type) -> type:
    return type(f"QueryRouted{module_class.__name__}", (_QueryRouted, module_class), {})


def route(texts: TextTypes, passage: Callable, query: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """passage(...) of the inputs' passage rows and query(...) of their query rows, in one tensor (the inputs
    share their leading dimensions with `texts.is_query`)."""
    if not texts.any:
        return passage(*inputs)
    if texts.all:
        return query(*inputs)
    passages = passage(*(x[texts.is_passage] for x in inputs))
    queries = query(*(x[texts.is_query] for x in inputs))
    out = passages.new_empty(*texts.is_query.shape, *passages.shape[1:])
    out[texts.is_passage] = passages
    out[texts.is_query] = queries
    return out
