"""BERT (Devlin et al. 2019): post-norm layers, learnt absolute positions, the MLM head's transform before the
tied decoder. RoBERTa and XLM-R (roberta.py) share all of it but their position offset, the unpadded path
(model.unpad, models/unpadding.py) included."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertModel
from transformers.models.bert.modeling_bert import BertLayer, BertPredictionHeadTransform

from pretrieve.models.backbones.base import Attend, Backbone
from pretrieve.models.unpadding import padded_mask


class BertFamilyStreams:
    """A BERT-family layer (attention.self.{query,key,value}, attention.output, intermediate, output) with its
    queries from the query stream H1 and its keys/values from the context stream H2: Q = H1 W^Q, K = H2 W^K,
    V = H2 W^V; A = softmax(Q K^T / sqrt(d) + M) V (RetroMAE eq. 3), added to H1 and through the feed-forward
    block, as the official RetroMAE decoder layer (a BertLayer) computes it. h1 = h2: plain self-attention."""

    def __init__(self, config):
        super().__init__(config)
        self.attention_dropout = config.attention_probs_dropout_prob

    def forward(self, h1: torch.Tensor, h2: torch.Tensor, attend: Attend) -> torch.Tensor:
        attention = self.attention.self
        q, k, v = (heads(x, attention.num_attention_heads)
                   for x in (attention.query(h1), attention.key(h2), attention.value(h2)))
        a = attend(q, k, v, self.attention_dropout if self.training else 0.0)
        x = self.attention.output(a.transpose(1, 2).reshape(h1.shape), h1)
        return self.output(self.intermediate(x), x)


def heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, L, hidden] -> [B, heads, L, d]."""
    batch, width, hidden = x.shape
    return x.view(batch, width, num_heads, hidden // num_heads).transpose(1, 2)


class BertDecoderLayer(BertFamilyStreams, BertLayer):
    pass


class BertBackbone(Backbone):
    name = model_type = "bert"
    model_class, config_class = BertModel, BertConfig
    model_kwargs = {"add_pooling_layer": True}  # kept, so that an export is a complete BertModel
    default_pad_token_id = 0
    display_name = "BERT"
    hf_mlm_keys = {"cls.predictions.transform.": "mlm_transform.", "cls.predictions.bias": "mlm_bias"}
    feed_forward_modules = ("intermediate", "output")
    has_pooler = True
    decoder_layer_class = BertDecoderLayer
    unpads = True

    @classmethod
    def packed_forward(cls, model, input_ids, packed, attention_mask):
        """The stack on one packed row: positions restart at each text, from the family's offset (RoBERTa's
        padding_idx + 1), and the token types, read from HF's buffer at those positions, are each text's own
        (all 0). Attention runs by cu_seqlens on the varlen kernel where it can, else padded under the padded
        batch's mask. The mask goes in even without padding: given none, HF (5.25 on) builds one of the packed row
        from the positions, which the padded fallback cannot take."""
        positions = packed.position_ids + cls.position_offset(model.config.pad_token_id)
        return model(input_ids=input_ids, attention_mask=padded_mask(model, attention_mask, ready=True),
                     position_ids=positions, packed=packed).last_hidden_state

    @classmethod
    def config(cls, options, pad_token_id: int):
        return cls.config_class(
            vocab_size=options.vocab_size, hidden_size=options.hidden_size, num_hidden_layers=options.num_layers,
            num_attention_heads=options.num_heads, intermediate_size=options.intermediate_size,
            max_position_embeddings=options.max_position_embeddings + cls.position_offset(pad_token_id),
            hidden_dropout_prob=options.dropout, attention_probs_dropout_prob=options.dropout,
            pad_token_id=pad_token_id)

    @staticmethod
    def position_offset(pad_token_id: int) -> int:
        """Where position 0's vector sits in the position table."""
        return 0

    @staticmethod
    def layers(model) -> nn.ModuleList:
        return model.encoder.layer

    @classmethod
    def position_vectors(cls, model, width: int, device: torch.device) -> torch.Tensor:
        positions = torch.arange(width, device=device) + cls.position_offset(model.config.pad_token_id)
        return model.embeddings.position_embeddings(positions)

    @staticmethod
    def mlm_transform(config) -> nn.Module:
        return BertPredictionHeadTransform(config)

    @classmethod
    def extend_positions(cls, model, positions: int) -> None:
        """Grow the learnt position table to `positions` rows past the offset; row offset + i copies old row
        offset + i mod (old positions), so every new block of positions starts as the trained one."""
        embeddings = model.embeddings
        offset = cls.position_offset(model.config.pad_token_id)
        old = embeddings.position_embeddings
        trained = old.num_embeddings - offset
        if positions <= trained:
            raise ValueError(f"model.extend_positions: {positions}, but the checkpoint has {trained} positions "
                             "already")
        table = nn.Embedding(offset + positions, old.embedding_dim, padding_idx=old.padding_idx)
        with torch.no_grad():
            table.weight[:offset] = old.weight[:offset]
            table.weight[offset:] = old.weight[offset + torch.arange(positions) % trained]
        embeddings.position_embeddings = table.to(old.weight.device)
        rows = torch.arange(offset + positions, device=old.weight.device).expand((1, -1))
        embeddings.position_ids = nn.Buffer(rows, persistent=False)
        embeddings.token_type_ids = nn.Buffer(torch.zeros_like(rows), persistent=False)
        model.config.max_position_embeddings = offset + positions

    @classmethod
    def decoder_layer(cls, config) -> nn.Module:
        return cls.decoder_layer_class(config)

    @staticmethod
    def init_new(model, module: nn.Module) -> None:
        """BERT's initialisation: normal(0, initializer_range), zero biases, LayerNorm 1/0."""
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=model.config.initializer_range)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
