"""`cotmote`: CoT-MoTE (its paper's §3.1-3.3, eqs. 7-12): CoT-MAE on a Mixture-of-Textual-Experts encoder."""

from __future__ import annotations

from dataclasses import dataclass

from pretrieve.data.cotmae import CoTMoTECollator
from pretrieve.models.heads.cotmae import CoTMAEHead, CoTMAEOptions, cotmae_flops
from pretrieve.models.heads.registry import option, register_method


@dataclass
class CoTMoTEOptions(CoTMAEOptions):
    max_len: int = option(144, at_least=3, why="[CLS], a token, [SEP]")  # §4.1: the corpus cut to 144 tokens
    # §4.1 decodes pseudo-queries (as CoT-MAE-qc); documents without them take the released CoT-MAE contexts
    context: str = option("auto", choices=("mixed", "random", "neighbour", "overlap", "query", "auto"))
    query_sources: tuple[str, ...] = ()  # corpus sources whose texts are queries (use the query experts)

    def __post_init__(self):
        super().__post_init__()
        self.query_sources = tuple(self.query_sources)


class CoTMoTEHead(CoTMAEHead):
    """CoT-MAE's L = L_enc + L_dec (released objective by default; eqs. 10-12 with `decoder_objective: clm`) with
    each layer's FFN split into a query and a passage expert behind one shared self-attention (eqs. 7-9;
    Encoder.add_query_experts); each encoded text takes the expert of its `text_type`. The experts start as
    copies of the initial FFN, so a BERT start gives both the same outputs."""

    def __init__(self, encoder, options):
        encoder.add_query_experts()
        super().__init__(encoder, options)


# the experts route each text through one FFN of the same shape: the FLOPs of CoT-MAE
register_method("cotmote", CoTMoTEHead, CoTMoTECollator, CoTMoTEOptions, flops=cotmae_flops)
