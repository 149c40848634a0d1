"""`cotmote`: CoT-MoTE (cot-mote.txt §3.1-3.3, eqs. 7-12): CoT-MAE on a Mixture-of-Textual-Experts encoder."""

from __future__ import annotations

from dataclasses import dataclass

from pretrieve.data.collators import CoTMoTECollator
from pretrieve.models.heads.cotmae import CoTMAEHead, CoTMAEOptions, cotmae_flops
from pretrieve.models.heads.registry import register_method


@dataclass
class CoTMoTEOptions(CoTMAEOptions):
    query_sources: tuple[str, ...] = ()  # corpus sources whose texts are queries (use the query experts)

    def __post_init__(self):
        super().__post_init__()
        self.query_sources = tuple(self.query_sources)


class CoTMoTEHead(CoTMAEHead):
    """CoT-MAE's L = L_mlm + L_dec (eqs. 10-12) with each layer's FFN split into a query and a passage expert
    behind one shared self-attention (eqs. 7-9; Encoder.add_query_experts); each text takes the expert of its
    `text_type`. The experts start as copies of the initial FFN, so a BERT start gives both the same outputs."""

    def __init__(self, encoder, options):
        encoder.add_query_experts()
        super().__init__(encoder, options)


# the experts route each text through one FFN of the same shape: the FLOPs of CoT-MAE
register_method("cotmote", CoTMoTEHead, CoTMoTECollator, CoTMoTEOptions, flops=cotmae_flops)
