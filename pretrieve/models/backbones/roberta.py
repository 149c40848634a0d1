"""RoBERTa (Liu et al. 2019) and XLM-RoBERTa (Conneau et al. 2020): BERT's layers and MLM head; positions
count from padding_idx + 1 (fairseq's convention), so the table holds max_len + pad + 1 rows (514 for 512
tokens), and the query stream's p_i is row pad + 1 + i."""

from __future__ import annotations

from transformers import RobertaConfig, RobertaModel, XLMRobertaConfig, XLMRobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLayer
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer

from pretrieve.models.backbones.bert import BertBackbone, BertFamilyStreams


class RobertaDecoderLayer(BertFamilyStreams, RobertaLayer):
    pass


class XLMRobertaDecoderLayer(BertFamilyStreams, XLMRobertaLayer):
    pass


class RobertaBackbone(BertBackbone):
    name = model_type = "roberta"
    model_class, config_class = RobertaModel, RobertaConfig
    default_pad_token_id = 1
    display_name = "RoBERTa"
    # RobertaLMHead: dense, gelu, layer_norm, then the tied decoder with `bias` (BERT's transform, other names)
    hf_mlm_keys = {"lm_head.dense.": "mlm_transform.dense.", "lm_head.layer_norm.": "mlm_transform.LayerNorm.",
                   "lm_head.bias": "mlm_bias"}
    decoder_layer_class = RobertaDecoderLayer

    @classmethod
    def config(cls, options, pad_token_id: int):
        config = super().config(options, pad_token_id)
        config.type_vocab_size = 1
        return config

    @staticmethod
    def position_offset(pad_token_id: int) -> int:
        return pad_token_id + 1


class XLMRobertaBackbone(RobertaBackbone):
    name = model_type = "xlm-roberta"
    display_name = "XLM-RoBERTa"
    model_class, config_class = XLMRobertaModel, XLMRobertaConfig
    decoder_layer_class = XLMRobertaDecoderLayer
