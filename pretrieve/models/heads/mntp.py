"""`mntp`: LLM2Vec's masked next-token prediction (BehnamGhader et al., COLM 2024, §2).

A decoder LLM made bidirectional (`model.bidirectional: true`) learns to use its right context the way it was
pre-trained to predict: a fraction of the text is masked as in BERT (80 % the mask token, 10 % a random one,
10 % kept), and the token at a masked position i is predicted from the state at i - 1, as next-token
prediction reads it, not from the state at i as BERT's MLM does. The prediction goes through the model's own
LM head, as LLM2Vec's does: the word embeddings where tied, its untied `lm_head` otherwise, no bias
(backbones/causal_lm.py).

Where pretrieve differs from LLM2Vec's code: its collator masks single tokens, pretrieve's masks whole words
(the MLM collator's rule); the ratio is LLM2Vec's 20 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrieve.data.collators import MLMCollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, no_flops, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class MNTPOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="bos, a token, eos")
    mlm_ratio: float = option(0.2, above=0, at_most=1)  # LLM2Vec's mlm_probability for Llama, Mistral, Qwen2


class MNTPHead(PretrainingHead):
    """L_mntp: cross-entropy of the masked token at i from the state at i - 1 (`mlm_labels` != -100 at i)."""

    decoder_llms = "bidirectional"  # causal, the state at i - 1 could not see what follows the mask

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        # position 0 (bos) is never masked: every masked token has a state before it
        loss = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels").shifted(hidden.shape[1]))
        return {"loss": loss, "mntp": loss.detach()}


register_method("mntp", MNTPHead, MLMCollator, MNTPOptions, flops=no_flops)  # the encoder alone
