"""`contrastive`: contrastive pre-training on (query, passage) pairs, InfoNCE over in-batch negatives (E5, Wang
et al. 2022 §3-4, arXiv:2212.03533; GTE, Li et al. 2023 §3, arXiv:2308.03281).

For the B pairs (q_i, d_i) of a batch, with s(q, d) = cos(q, d) / tau (or the inner product, `normalize: false`),
q->d (E5 eq. 1): L_i = -log( exp(s(q_i, d_i)) / sum_{d in D} exp(s(q_i, d)) ), D every passage of the global
batch (positives and the pairs' own negatives, gathered from every rank in rank order) but the masked ones.
With `symmetric`, d->q as well: L'_i = -log( exp(s(q_i, d_i)) / sum_{q in Q} exp(s(q, d_i)) ), and the loss is
(mean L + mean L') / 2 (GTE §3.2 extends the partition function in both directions).

False negatives, never the positive itself, are left out of D and Q: a passage whose text equals the positive's
(`mask_same_text`), the passages of other pairs from the same document (`mask_same_doc`), and with `mask_margin`
m any candidate whose similarity beats the positive's by more than m (GTE / nomic-embed's filter). Each
reason's count is logged (`masked_text`, `masked_doc`, `masked_margin`: per micro-batch, summed over anchors).

With `matryoshka_dims` M (and `matryoshka_weights` c), the loss is sum_{m in M} c_m * L(z_{1:m}) (Kusupati et al.
2022 eq. 1; models/matryoshka.py): the loss above on the vectors' first m coordinates, re-normalised, each m's
logged as `loss@<m>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrieve.data.collators import collator_from_options, pad_texts, text_hash
from pretrieve.data.masking import Vocabulary
from pretrieve.models.backbones import backbone_of
from pretrieve.models.dense_pooling import POOLINGS
from pretrieve.models.flops import layer_flops
from pretrieve.models.grad_cache import encode_in_chunks, grad_cache_of
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.infonce import gather_candidates, info_nce, world
from pretrieve.models.matryoshka import check_width, matryoshka_loss, matryoshka_of


@dataclass
class ContrastiveOptions(MethodOptions):
    max_len: int = option(128, at_least=3, why="[CLS], a token, [SEP]")  # E5 §4.1: 128 tokens
    query_max_len: int = option(128, at_least=3, why="[CLS], a token, [SEP]")
    pooling: str = option("mean", choices=("mean", "cls", "last"))  # E5 §4.1: average; last: decoder LLMs
    normalize: bool = True  # cosine similarity (E5 eq. 1)
    temperature: float = option(0.01, above=0)  # E5 §4.1, GTE §4.1
    learn_temperature: bool = False  # tau learnt from `temperature` (as log 1/tau, CLIP's logit scale)
    symmetric: bool = False  # also d->q (GTE §3.2); E5 is q->d only
    negatives: int = option(0, at_least=0)  # the pair's own negatives per pair, beside the in-batch ones
    cross_device: bool = True  # candidates from every rank
    mask_same_text: bool = True
    mask_same_doc: bool = True
    mask_margin: float | None = option(None, at_least=0)  # GTE / nomic: mask s(q, d) > s(q, d+) + margin
    grad_cache: dict | None = None  # {chunk: N}: GradCache (models/grad_cache.py)
    matryoshka_dims: list[int] | None = None  # e.g. [768, 256, 64]: the loss summed over these prefixes
    matryoshka_weights: list[float] | None = None  # c_m, one per dimension (default 1 each)

    def __post_init__(self):
        super().__post_init__()
        grad_cache_of(self.grad_cache, "method")
        matryoshka_of(self.matryoshka_dims, self.matryoshka_weights, "method")


@dataclass
class ContrastiveCollator:
    """Batches of (query, passage) pairs for contrastive pre-training, from a pair stream's samples (`query`,
    `pos`, `negs`: token ids without special tokens; `source`, `doc`):

    - `q_input_ids` / `q_attention_mask` [B, Lq] and `p_input_ids` / `p_attention_mask` [B, Lp]: [CLS] text [SEP];
    - with `negatives` N > 0, the pair's own negatives `n_input_ids` / `n_attention_mask` [B x N, Ln] (row i's
      at i x N ...), N of them drawn when it has more, and `n_valid` [B x N] False where it has fewer;
    - for false-negative masking: `q_hash`, `p_hash` [B] and `n_hash` [B x N] (the texts' fingerprints, uncut),
      `doc_hash` [B] (the pair's source and document);
    - `pad` [B]: stream pad samples, which are neither anchors nor candidates.
    """

    vocab: Vocabulary
    max_len: int = 128
    query_max_len: int = 128
    negatives: int = 0
    seed: int = 0
    pad_to_multiple_of: int = 8
    data_kind: ClassVar[str] = "pairs"

    @classmethod
    def from_options(cls, options, vocab: Vocabulary, seed: int = 0):
        return collator_from_options(cls, options, vocab, seed)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        queries = [np.asarray(s["query"], dtype=np.int64) for s in samples]
        passages = [np.asarray(s["pos"], dtype=np.int64) for s in samples]
        out = {}
        for prefix, texts, max_len in (("q", queries, self.query_max_len), ("p", passages, self.max_len)):
            ids, mask = pad_texts(texts, max_len, self.vocab, self.pad_to_multiple_of)
            out[f"{prefix}_input_ids"], out[f"{prefix}_attention_mask"] = torch.from_numpy(ids), torch.from_numpy(mask)
            out[f"{prefix}_hash"] = torch.tensor([text_hash(t) for t in texts], dtype=torch.int64)
        out["doc_hash"] = torch.tensor([text_hash(np.frombuffer(f"{s.get('source', '')}\0{s.get('doc', '')}".encode(),
                                                                dtype=np.uint8)) for s in samples], dtype=torch.int64)
        out["pad"] = torch.tensor([bool(s.get("pad", False)) for s in samples])
        if self.negatives:
            rng = np.random.default_rng([self.seed, samples[0].get("epoch", 0), samples[0].get("shard", 0),
                                         samples[0].get("index", 0), len(samples)])
            negatives, valid = [], []
            for s in samples:
                own = [np.asarray(n, dtype=np.int64) for n in (s.get("negs") or [])]
                if len(own) > self.negatives:
                    own = [own[i] for i in sorted(rng.choice(len(own), self.negatives, replace=False))]
                valid += [True] * len(own) + [False] * (self.negatives - len(own))
                negatives += own + [np.empty(0, dtype=np.int64)] * (self.negatives - len(own))
            ids, mask = pad_texts(negatives, self.max_len, self.vocab, self.pad_to_multiple_of)
            out["n_input_ids"], out["n_attention_mask"] = torch.from_numpy(ids), torch.from_numpy(mask)
            out["n_valid"] = torch.tensor(valid)
            out["n_hash"] = torch.tensor([text_hash(t) for t in negatives], dtype=torch.int64)
        return out

    @staticmethod
    def count(batch: dict) -> tuple[int, int, int]:
        """(pairs, non-padding tokens, positions) of a batch: every text, queries, passages and negatives."""
        masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
        return len(batch["q_attention_mask"]), int(sum(m.sum() for m in masks)), sum(m.numel() for m in masks)



@dataclass
class PairMeta:
    """What false-negative masking reads of the global batch (gathered in rank order, as the vectors)."""

    q_hash: torch.Tensor  # [Nq]
    doc: torch.Tensor  # [Nq]
    q_pad: torch.Tensor  # [Nq]
    d_hash: torch.Tensor  # [Nd] passages: positives, then negatives
    d_doc: torch.Tensor  # [Nd] the pair's document for a positive; -1 (none) for a negative
    d_off: torch.Tensor  # [Nd] True: not a candidate (a pad sample's passage, a missing negative)


def masked_candidates(similarity: torch.Tensor, target: torch.Tensor, anchor_hash: torch.Tensor,
                      anchor_doc: torch.Tensor, cand_hash: torch.Tensor, cand_doc: torch.Tensor,
                      cand_off: torch.Tensor, options: ContrastiveOptions,
                      counted: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """(excluded [A, C], counts by reason) for anchors against candidates; `similarity` [A, C] detached, before
    the temperature; `anchor_hash` [A] the hash of each anchor's positive (the text the candidates must not
    repeat). A candidate is counted under the first reason that masks it, in the rows of `counted` [A] (the real
    anchors: a pad sample's row, a copy of a real one, would count its twin as a false negative)."""
    rows = torch.arange(len(target), device=target.device)
    own = torch.zeros_like(similarity, dtype=torch.bool)
    own[rows, target] = True
    left = ~own & ~cand_off[None, :]
    counts = {}
    reasons = [("masked_text", options.mask_same_text, lambda: cand_hash[None, :] == anchor_hash[:, None]),
               ("masked_doc", options.mask_same_doc,
                lambda: (cand_doc[None, :] == anchor_doc[:, None]) & (cand_doc[None, :] != -1)),
               ("masked_margin", options.mask_margin is not None,
                lambda: similarity > similarity[rows, target][:, None] + options.mask_margin)]
    excluded = cand_off[None, :] & ~own
    for name, on, rule in reasons:
        hit = left & rule() if on else torch.zeros_like(left)
        counts[name] = (hit if counted is None else hit & counted[:, None]).sum()
        excluded, left = excluded | hit, left & ~hit
    return excluded, counts


def pair_loss(q: torch.Tensor, d: torch.Tensor, meta: PairMeta, first_q: int, first_d: int, scale: torch.Tensor,
              options: ContrastiveOptions, all_q: torch.Tensor, all_d: torch.Tensor, world_size: int = 1,
              anchors_total: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This rank's share of the global batch's mean loss: q [B, d] its queries, d [B, d] its positives; all_q /
    all_d the global batch's queries and passages (this rank's at first_q / first_d), `scale` 1 / tau. Pad samples
    are no anchors. DeepSpeed averages the `world_size` ranks' gradients (and the engine their logged values), so
    each rank's sum over its anchors is divided by the global batch's anchors over `world_size`: the average is
    the global mean also when the ranks hold different numbers of anchors (an epoch's tail). `anchors_total`: the
    global batch's anchors when `meta` holds this rank's rows alone (no cross-rank negatives)."""
    b = len(q)
    anchors = ~meta.q_pad[first_q:first_q + b]
    total = (~meta.q_pad).sum() if anchors_total is None else anchors_total
    share = world_size / total.clamp(min=1)
    similarity = q @ all_d.T  # [B, Nd]
    target = first_d + torch.arange(b, device=q.device)
    excluded, counts = masked_candidates(similarity.detach(), target, meta.d_hash[first_d:first_d + b],
                                         meta.doc[first_q:first_q + b], meta.d_hash, meta.d_doc, meta.d_off, options,
                                         anchors)
    qd = info_nce(similarity * scale, target, excluded)
    out = {"qd": (qd * anchors).sum() * share}
    accuracy = (similarity.detach().masked_fill(excluded, float("-inf")).argmax(dim=-1) == target).float()
    out["accuracy"] = (accuracy * anchors).sum() * share
    loss = out["qd"]
    if options.symmetric:
        back = d @ all_q.T  # [B, Nq]
        target = first_q + torch.arange(b, device=q.device)
        excluded, more = masked_candidates(back.detach(), target, meta.q_hash[first_q:first_q + b],
                                           meta.doc[first_q:first_q + b], meta.q_hash, meta.doc, meta.q_pad, options,
                                           anchors)
        out["dq"] = (info_nce(back * scale, target, excluded) * anchors).sum() * share
        counts = {k: counts[k] + more[k] for k in counts}
        loss = (out["qd"] + out["dq"]) / 2
    return {"loss": loss, **{k: v.detach() for k, v in out.items()}, **{k: v.float() for k, v in counts.items()}}


class ContrastiveHead(PretrainingHead):
    """InfoNCE over in-batch (and cross-rank, and the pairs' own) negatives; see the module docstring. The
    encoder's MLM head takes no part: it is frozen and exported as it came."""

    decoder_llms = "any"  # causal decoders pool their last token (pooling: last)
    predicts_tokens = False

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        for _, param in encoder.token_head_parameters():  # the MLM transform and bias, or an untied LM head
            param.requires_grad_(False)
        self.pool = POOLINGS[options.pooling]
        # log(1 / tau), CLIP's logit scale; one element, not a scalar (DeepSpeed broadcasts weights as bytes)
        self.log_scale = nn.Parameter(torch.full((1,), math.log(1 / options.temperature)),
                                      requires_grad=options.learn_temperature)
        cache = grad_cache_of(options.grad_cache, "method")
        self.chunk = None if cache is None else cache.chunk
        self.grad_cache = True  # with a chunk: GradCache; False: the chunks under one graph (its reference)
        self.matryoshka = matryoshka_of(options.matryoshka_dims, options.matryoshka_weights, "method")
        check_width(self.matryoshka, encoder.config.hidden_size, "method")

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        vectors = self.pool(self.encoder(input_ids, attention_mask), attention_mask)
        return F.normalize(vectors, dim=-1) if self.options.normalize else vectors

    def forward(self, batch):
        groups = [(batch["q_input_ids"], batch["q_attention_mask"]), (batch["p_input_ids"], batch["p_attention_mask"])]
        negatives = "n_input_ids" in batch
        if negatives:
            groups.append((batch["n_input_ids"], batch["n_attention_mask"]))
        params = [p for p in self.encoder.parameters() if p.requires_grad]
        q, d, *n = encode_in_chunks(self.encode, groups, self.chunk, params, cache=self.grad_cache)
        pad = batch["pad"].bool()
        passages = torch.cat([d, *n])
        d_doc = batch["doc_hash"]
        d_hash, d_off = batch["p_hash"], pad
        if negatives:
            per = len(n[0]) // len(q)
            d_doc = torch.cat([d_doc, torch.full_like(batch["n_hash"], -1)])  # a negative's document: unknown
            d_hash = torch.cat([d_hash, batch["n_hash"]])
            d_off = torch.cat([pad, ~batch["n_valid"].bool() | pad.repeat_interleave(per)])
        cross = self.options.cross_device
        all_q, first_q = gather_candidates(q, cross)
        all_d, first_d = gather_candidates(passages, cross)
        meta = PairMeta(*(gather_candidates(t, cross)[0] for t in (batch["q_hash"], batch["doc_hash"], pad, d_hash,
                                                                     d_doc, d_off)))
        scale = self.log_scale.exp()[0]
        rank_count = world()[1]
        total = None  # the gathered pads count the global batch's anchors; without them, a sum over the ranks
        if rank_count > 1 and not cross:
            total = (~pad).sum()
            dist.all_reduce(total)
        def loss_of(q, d, all_q, all_d):
            return pair_loss(q, d, meta, first_q, first_d, scale, self.options, all_q, all_d, rank_count, total)

        if self.matryoshka is None:
            out = loss_of(q, d, all_q, all_d)
        else:  # the full-width vectors gathered once, cut after: a prefix of the gather is the gather of prefixes
            out = matryoshka_loss(loss_of, [q, d, all_q, all_d], self.matryoshka, self.options.normalize)
        if self.options.learn_temperature:
            out["temperature"] = (1 / scale).detach()
        return out


def contrastive_flops(options: ContrastiveOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The encoder over every text of the batch (queries, positives, negatives) with its pooler; the score
    matrix (B x candidates x h) is left out. GradCache's second encoding is recomputation, not counted (as
    activation checkpointing's is not)."""
    total = 0
    for prefix in ("q", "p", "n"):
        if f"{prefix}_input_ids" in batch:
            b, length = batch[f"{prefix}_input_ids"].shape
            total += config.num_hidden_layers * layer_flops(config, b, length, length)
            total += 2 * b * config.hidden_size ** 2 if backbone_of(config).has_pooler else 0
    return total


register_method("contrastive", ContrastiveHead, ContrastiveCollator, ContrastiveOptions, flops=contrastive_flops)
