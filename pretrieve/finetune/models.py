"""The fine-tuned models: a shared-weight dual encoder (stages 1-3) and the cross-encoder teacher (stage 3).

Losses, RetroMAE-2 (ACL 2023) §3.5 (scores s(q, d) = <q, d> / temperature; eqs. 13-15 use 1):
- `contrastive`: -log softmax of the positive among the candidates. The candidates are the query's own group
  (positive + hard negatives D^-, eq. 14), plus with `in_batch` every other passage of the batch (IB, eq. 13),
  gathered from every rank when `cross_device` (world > 1). Stage 1 is this loss with negatives = 0 (or BM25
  negatives), stage 2 with mined hard negatives.
- `triplet`: the SEED-Encoder paper §4.2, relu(margin - (s(q, d+) - s(q, d-))) averaged over the query's negatives.
- `distill`: eq. 15's soft-label cross-entropy over the query's group {d+, D^-}: the targets sigma_q^d are the
  softmax of the cross-encoder's scores (`teacher_scores`), the prediction the softmax of the student's.
CoT-MoTE (its paper's §3.3): when the encoder has query experts and `text_experts` is on, queries go
through the query experts and passages through the passage experts; the self-attention is shared.
DupMAE (pooling `dupmae`): <q, d> is eq. (12), the inner product of JointRepresentation.vectors, so every loss
above trains W^cls, the LPU and the encoder through the joint score, as §3.4-3.5 fine-tune it.
Sparse (pooling `sparse`; LexMAE's and SPLADE's fine-tuning): <q, d> is the inner product of the SPLADE vectors
(models.representation.splade_vectors, the CoT-MoTE paper eq. 4: over the tokens between [CLS] and [SEP], as LexMAE's
released fine-tuning, or over those too with `sparse_special_tokens`, as SPLADE's), and the loss adds the FLOPS regulariser of the
queries' and of the passages' vectors (Paria et al. 2020), weighted by `flops` (query, passage); each is logged
unweighted as `flops_query` / `flops_passage`, with the mean non-zero entries a vector keeps (`query_terms`,
`passage_terms`), and the ranking loss alone as `ranking_loss`.
Matryoshka (`matryoshka_dims`, models/matryoshka.py; Kusupati et al. 2022 eq. 1): any loss above, summed over
the vectors' prefixes (re-normalised with `normalize`), each dimension's logged as `loss@<m>`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrieve.models.grad_cache import encode_in_chunks
from pretrieve.models.infonce import gather_candidates, info_nce
from pretrieve.models.matryoshka import Matryoshka, check_width, matryoshka_loss
from pretrieve.models.poolings import DUAL_POOLINGS
from pretrieve.models.representation import POOLINGS, JointRepresentation, flops_regularizer, splade_vectors

LOSSES = ("contrastive", "triplet", "distill")


class DualEncoder(nn.Module):
    def __init__(self, encoder, loss: str = "contrastive", pooling: str = "cls", normalize: bool = False,
                 temperature: float = 1.0, in_batch: bool = True, cross_device: bool = True, margin: float = 1.0,
                 text_experts: bool = True, joint: JointRepresentation | None = None, grad_cache: int | None = None,
                 matryoshka: Matryoshka | None = None, flops: tuple[float, float] = (0.0, 0.0),
                 sparse_special_tokens: bool = False):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"finetune.loss: {loss!r} is not one of {', '.join(LOSSES)}")
        if pooling not in DUAL_POOLINGS:
            raise ValueError(f"finetune.pooling: {pooling!r} is not one of {', '.join(DUAL_POOLINGS)}")
        if (pooling == "dupmae") != (joint is not None):
            raise ValueError("pooling dupmae and a JointRepresentation go together")
        if pooling == "dupmae" and normalize:
            raise ValueError("finetune.normalize: pooling dupmae scores with eq. (12), an unnormalised inner product")
        if temperature <= 0:
            raise ValueError(f"finetune.temperature: must be > 0, got {temperature}")
        if matryoshka is not None and joint is not None:
            raise ValueError("finetune.matryoshka_dims: pooling dupmae's eq. (12) vectors have no prefixes to train")
        if pooling == "sparse" and (problems := sparse_problems(normalize, matryoshka is not None, not any(
                line.startswith("MLM head") for line in encoder.load_report))):
            raise ValueError("\n".join(problems))
        if any(weight < 0 for weight in flops) or (pooling != "sparse" and any(flops)):
            raise ValueError(f"finetune.flops: weights >= 0 of pooling sparse's FLOPS regulariser, got {list(flops)} "
                             f"with pooling {pooling}")
        check_width(matryoshka, encoder.config.hidden_size, "finetune")
        self.encoder, self.joint = encoder, joint
        self.loss_name, self.pool, self.normalize = loss, POOLINGS.get(pooling), normalize
        self.temperature, self.in_batch, self.cross_device, self.margin = temperature, in_batch, cross_device, margin
        self.routed = text_experts and encoder.query_experts is not None
        self.chunk = grad_cache  # GradCache's chunk (models/grad_cache.py); None: the whole batch at once
        self.matryoshka = matryoshka
        self.sparse, self.flops, self.sparse_special_tokens = pooling == "sparse", flops, sparse_special_tokens

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, queries: bool) -> torch.Tensor:
        text_type = None
        if self.routed:
            text_type = torch.full((len(input_ids),), int(queries), dtype=torch.long, device=input_ids.device)
        hidden = self.encoder(input_ids, attention_mask, text_type=text_type)
        if self.joint is not None:
            return self.joint.vectors(self.encoder, hidden, attention_mask, documents=not queries)
        if self.sparse:
            return splade_vectors(self.encoder, hidden, attention_mask, self.sparse_special_tokens)
        vectors = self.pool(hidden, attention_mask)
        return F.normalize(vectors, dim=-1) if self.normalize else vectors

    def _embed_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, queries: torch.Tensor):
        return self.embed(input_ids, attention_mask, queries=bool(queries[0]))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        groups = []
        for prefix, queries in (("query", True), ("passage", False)):
            ids = batch[f"{prefix}_input_ids"]
            groups.append((ids, batch[f"{prefix}_attention_mask"],
                           torch.full((len(ids),), queries, dtype=torch.bool, device=ids.device)))
        params = [p for p in self.parameters() if p.requires_grad]
        q, p = encode_in_chunks(self._embed_rows, groups, self.chunk, params)
        teacher = batch.get("teacher_scores")
        if self.sparse:
            return self.with_flops(self.loss_of(q, p, teacher), q, p)
        if self.matryoshka is None:
            return self.loss_of(q, p, teacher)
        return matryoshka_loss(lambda q, p: self.loss_of(q, p, teacher), [q, p], self.matryoshka, self.normalize)

    def loss_of(self, q: torch.Tensor, p: torch.Tensor, teacher: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The loss and accuracy of queries q [B, d] against their groups p [B x G, d] (positive first)."""
        if self.loss_name == "contrastive":
            loss, scores, target = contrastive_loss(q, p, self.temperature, self.in_batch, self.cross_device)
        else:
            scores, target = group_scores(q, p, self.temperature)
            if self.loss_name == "distill":
                loss = -(torch.softmax(teacher.float(), dim=-1) * torch.log_softmax(scores.float(), dim=-1)
                         ).sum(dim=-1).mean()
            else:
                if scores.shape[1] < 2:
                    raise ValueError("finetune.loss triplet: needs finetune.negatives >= 1")
                loss = F.relu(self.margin - (scores[:, :1] - scores[:, 1:])).mean()
        accuracy = (scores.argmax(dim=-1) == target).float().mean()
        return {"loss": loss, "accuracy": accuracy.detach()}

    def with_flops(self, out: dict[str, torch.Tensor], q: torch.Tensor, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """`out` with the FLOPS regulariser of this rank's queries and passages added to its loss (per device, as
        SPLADE's and LexMAE's released code do), and the sparsity logged."""
        query_flops, passage_flops = flops_regularizer(q), flops_regularizer(p)
        ranking = out["loss"]
        return {**out, "loss": ranking + self.flops[0] * query_flops + self.flops[1] * passage_flops,
                "ranking_loss": ranking.detach(), "flops_query": query_flops.detach(),
                "flops_passage": passage_flops.detach(), "query_terms": (q > 0).sum(dim=1).float().mean().detach(),
                "passage_terms": (p > 0).sum(dim=1).float().mean().detach()}


def sparse_problems(normalize: bool, matryoshka: bool, has_head: bool = True) -> list[str]:
    """What pooling sparse cannot train with, one message a setting, a model with no MLM head first (the model and
    the config check share them)."""
    return [*([] if has_head else ["finetune.pooling: sparse scores through the model's MLM head, and init_from has "
                                   "none (a checkpoint of the backbone alone, as sentence-transformers and AutoModel "
                                   "save it): start from one with its MLM head, or give a dense pooling"]),
            *(["finetune.normalize: pooling sparse scores SPLADE vectors by their inner product, as their inverted "
               "index does; leave normalize off"] if normalize else []),
            *(["finetune.matryoshka_dims: pooling sparse's vectors are the vocabulary's, whose prefixes are no "
               "representation; give a dense pooling (cls, mean, last)"] if matryoshka else [])]


def group_scores(q: torch.Tensor, p: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's scores [B, G] against its own group (p [B x G, d], positive first), and the positives (0)."""
    scores = torch.einsum("bd,bgd->bg", q, p.view(q.shape[0], -1, p.shape[-1])) / temperature
    return scores, torch.zeros(len(q), dtype=torch.long, device=q.device)


def contrastive_loss(q: torch.Tensor, p: torch.Tensor, temperature: float = 1.0, in_batch: bool = True,
                     cross_device: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eqs. 13-14 for queries q [B, d] and their groups p [B x G, d] (positive first): (mean loss, scores
    [B, candidates], index of each query's positive among the candidates). With `cross_device`, the
    candidates are every rank's passages, in rank order; gradients flow back to this rank's own."""
    if not in_batch:
        scores, target = group_scores(q, p, temperature)
    else:
        size = p.shape[0] // q.shape[0]
        p, first = gather_candidates(p, cross_device)
        scores = q @ p.T / temperature
        target = first + torch.arange(len(q), device=q.device) * size
    return info_nce(scores, target).mean(), scores, target


class CrossEncoder(nn.Module):
    """BERT over "[CLS] query [SEP] passage [SEP]", a linear score on [CLS] (HF BertForSequenceClassification,
    one label), trained to pick the positive of each group (softmax cross-entropy over the group, as for the
    dual encoder's eq. 14 without in-batch negatives). Its scores are the teacher's for eq. 15."""

    def __init__(self, model, group_size: int):
        super().__init__()
        if group_size < 2:
            raise ValueError("the cross-encoder teacher learns from negatives: finetune.negatives must be >= 1")
        self.model, self.group_size = model, group_size

    def scores(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).logits.squeeze(-1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scores = self.scores(batch["pair_input_ids"], batch["pair_attention_mask"], batch["pair_token_type_ids"])
        groups = scores.float().view(-1, self.group_size)
        target = torch.zeros(len(groups), dtype=torch.long, device=groups.device)
        return {"loss": F.cross_entropy(groups, target),
                "accuracy": (groups.argmax(dim=-1) == target).float().mean().detach()}
