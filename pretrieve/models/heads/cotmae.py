"""`cotmae`: CoT-MAE (Wu et al. 2022, "ConTextual Masked Auto-Encoder for Dense Passage Retrieval") as the
released code (caskcsg/ir `cotmae/`) trains it; `decoder_objective: clm` is the CoT-MoTE paper's summary of it
(the CoT-MoTE paper §3.2, eqs. 10-12). docs/methods.md says what still differs from the released code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrieve.data.cotmae import CoTMAECollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import CausalDecoder, Decoder, causal_decoder_flops, masked_attention
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class CoTMAEOptions(MethodOptions):
    max_len: int = option(128, at_least=3, why="[CLS], a token, [SEP]")  # released: --max_seq_length 128
    mlm_ratio: float = option(0.30, above=0, at_most=1)  # released: --encoder_mask_ratio 0.30
    decoder_layers: int = option(2, at_least=1)  # released: --n_head_layers 2
    # mlm: the released objective (each text of a pair decoded from the other's [CLS], masked, both ways);
    # clm: the CoT-MoTE paper's summary (the anchor's [CLS] predicts its whole context token by token)
    decoder_objective: str = option("mlm", choices=("mlm", "clm"))
    # the mask of the decoder's input (mlm only; None: the released --decoder_mask_ratio 0.45)
    decoder_mask_ratio: float | None = option(None, above=0, at_most=1)
    # the context: mixed (the released: a random other span, a neighbour or an overlapping span, 1/3 each),
    # one of those kinds, query (pseudo-queries), auto (a pseudo-query when the document has one, else mixed)
    context: str = option("mixed", choices=("mixed", "random", "neighbour", "overlap", "query", "auto"))

    def __post_init__(self):
        super().__post_init__()
        if self.decoder_objective == "clm" and self.decoder_mask_ratio is not None:
            raise ValueError("method.decoder_mask_ratio: decoder_objective clm decodes the whole context "
                             "unmasked; only the mlm objective masks the decoder's input")
        if self.decoder_objective == "mlm" and self.decoder_mask_ratio is None:
            self.decoder_mask_ratio = 0.45

    @classmethod
    def saved(cls, values):
        # an export written before `decoder_objective` existed trained the CLM summary: it continues as it was
        return {"decoder_objective": "clm", **values}


class CoTMAEHead(PretrainingHead):
    """L = L_enc + L_dec, each a mean over its batch's targets (the released code's two cross-entropies).

    mlm: the encoder reads rows [a0, c0, a1, c1, ...] (anchors and contexts, masked) and L_enc is their MLM loss;
    the decoder of row r reads r's [CLS] state followed by the embeddings of row r ^ 1's text masked anew,
    through `decoder_layers` bidirectional layers, and L_dec is the shared MLM head's loss at those masks.
    clm: the encoder reads the masked anchors; a causal decoder conditioned only on the anchor's [CLS] state
    predicts its context token by token (eq. 12)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        clm = options.decoder_objective == "clm"
        self.decoder = CausalDecoder(encoder, options.decoder_layers, window=None) if clm \
            else Decoder(encoder, options.decoder_layers)

    def forward(self, batch):
        # text_type only in CoT-MoTE batches: it picks each text's expert (cotmote.py)
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"], batch.get("text_type"))
        mlm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        if self.options.decoder_objective == "clm":
            dec = self.decoder.loss(self.encoder, hidden[:, 0], batch["ctx_input_ids"], batch["ctx_attention_mask"],
                                    token_targets(batch, "ctx_labels"))
        else:
            dec = self.encoder.token_loss(self.decode(hidden[:, 0], batch), token_targets(batch, "dec_labels"))
        return {"loss": mlm + dec, "mlm": mlm.detach(), "dec": dec.detach()}

    def decode(self, h_cls: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The decoder's states over [h_cls of row r, the embeddings of row r ^ 1's masked text after its [CLS]]."""
        ids, mask = batch["dec_input_ids"], batch["dec_attention_mask"]
        x = torch.cat([h_cls[:, None], self.encoder.embeddings(input_ids=ids)[:, 1:]], dim=1)
        visible = mask.bool()[:, None, :].expand(-1, ids.shape[1], -1)  # padding hidden, every token seen
        return self.decoder(x, None, masked_attention(visible))


def cotmae_flops(options: CoTMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The decoder's layers over its input (mlm: the partners' texts, one per encoder row; clm: the contexts) and
    the MLM head at its targets; the encoder's pass over every row is counted with the encoder."""
    if options.decoder_objective == "clm":
        return causal_decoder_flops(options.decoder_layers, config, batch["ctx_input_ids"], batch["ctx_labels"])
    return causal_decoder_flops(options.decoder_layers, config, batch["dec_input_ids"], batch["dec_labels"])


register_method("cotmae", CoTMAEHead, CoTMAECollator, CoTMAEOptions, flops=cotmae_flops, eval_pooling="cls",
                study_arm=6)
