"""COSTA (the COSTA paper §3.2-3.3, §4.5.1) written out from the paper in plain torch, against the `costa` head and
collator.

The loss is recomputed from the head's own weights and the encoder's output vectors h (eq. 4, HF BertModel)
without costa.py's code: the projector g as two explicit affine maps with a ReLU (eqs. 5-6), each span's mean
as a slice (eq. 7), eq. 8 as loops over texts and their spans, and BERT's MLM head by hand (eq. 9).
The span tests add what tests/test_heads_part2.py does not check: the count per level and the uniform start.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pretrieve.models.heads.costa import COSTACollator
from pretrieve.data.spans import LEVELS
from pretrieve.models.heads import get_method
from test_heads import tiny
from test_heads_part2 import _costa_batches


def build(wiki_samples, vocab, dtype, **overrides):
    spec, options, model = tiny("costa", **overrides)
    model.dropout = 0.0
    head = spec.build(options, model, seed=0).to(dtype).eval()
    # a 10-token text has only word and phrase spans, a 40-token one no paragraph span: |P(i)| < 4T
    short = [dict(s, ids=s["ids"][:n]) for s, n in zip(wiki_samples[4:6], (10, 40))]
    batch = spec.collator.from_options(options, vocab, seed=0)(wiki_samples[:4] + short)
    return head, options, batch


def affine(x, module: nn.Linear):
    return x @ module.weight.T + module.bias


def text_representations(head, h_cls):
    """Eqs. 5-6: z = g(h_[CLS]), g(x) = W2 ReLU(W1 x + b1) + b2, a two-layer FFN with a non-linear activation."""
    first, second = [m for m in head.projector.modules() if isinstance(m, nn.Linear)]
    return affine(torch.relu(affine(h_cls, first)), second)


def span_representations(h, bounds) -> list[list[torch.Tensor]]:
    """Eq. 7: per text, the average of the output vectors over each of its spans (end exclusive here)."""
    return [[h[b, start:end].mean(dim=0) for start, end in bounds[b].tolist() if start >= 0] for b in range(len(h))]


def group_wise_contrastive_loss(z, spans, tau, denominator="all but z_i"):
    """Eq. 8 with dot products: for text i and its spans P(i),
    L_i = -1/|P(i)| sum_{p in P(i)} log( exp(z_i.s_p/tau) / sum_{a in A(i)} exp(z_i.a/tau) ),
    A(i) = every representation of the batch (N texts and all their spans) but z_i itself (Khosla et al. 2020,
    whom §3.2 follows); averaged over the texts. "other groups" is the other reading of §3.2's prose: each positive
    against only the representations of the other texts' groups."""
    candidates = [(j, z_j) for j, z_j in enumerate(z)] + [(j, s) for j, group in enumerate(spans) for s in group]
    losses = []
    for i, z_i in enumerate(z):
        if not spans[i]:
            continue

        def score(a):
            return torch.exp(z_i @ a / tau)

        if denominator == "all but z_i":
            total = sum(score(a) for k, (_, a) in enumerate(candidates) if k != i)
            terms = [score(p) / total for p in spans[i]]
        else:  # each positive against the other groups only
            rest = sum(score(a) for j, a in candidates if j != i)
            terms = [score(p) / (score(p) + rest) for p in spans[i]]
        losses.append(-sum(torch.log(t) for t in terms) / len(spans[i]))
    return sum(losses) / len(losses)


def mlm_loss(head, h, labels):
    """Eq. 9: mean cross-entropy of BERT's MLM head (dense, GELU, LayerNorm, tied word embeddings + bias)."""
    encoder, keep = head.encoder, labels != -100
    t = affine(h[keep], encoder.mlm_transform.dense)
    t = F.layer_norm(F.gelu(t), t.shape[-1:], encoder.mlm_transform.LayerNorm.weight,
                     encoder.mlm_transform.LayerNorm.bias, encoder.mlm_transform.LayerNorm.eps)
    logits = t @ encoder.model.embeddings.word_embeddings.weight.T + encoder.mlm_bias
    return F.cross_entropy(logits, labels[keep])


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("overrides", [{}, {"temperature": 0.5, "mlm_weight": 0.3, "spans_per_level": 3}])
def test_costa_loss_by_equations(wiki_samples, vocab, dtype, rel, overrides):
    """L = L_CSP + lambda L_MLM (§3.3, lambda = `mlm_weight`) from eqs. 5-9, for the paper settings and others."""
    head, options, batch = build(wiki_samples, vocab, dtype, **overrides)
    with torch.no_grad():
        out = head(batch)
        h = head.encoder.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        z = text_representations(head, h[:, 0])
        spans = span_representations(h, batch["span_bounds"])
        csp = group_wise_contrastive_loss(z, spans, options.temperature)
        mlm = mlm_loss(head, h, batch["mlm_labels"])
    assert [len(s) for s in spans][-2:] == [2 * options.spans_per_level, 3 * options.spans_per_level]
    assert out["csp"].item() == pytest.approx(csp.item(), rel=rel)
    assert out["mlm"].item() == pytest.approx(mlm.item(), rel=rel)
    assert out["loss"].item() == pytest.approx((csp + options.mlm_weight * mlm).item(), rel=rel)
    # the test tells the readings of eq. 8 apart: own spans kept out of the denominator is another loss
    other = group_wise_contrastive_loss(z, spans, options.temperature, denominator="other groups")
    assert abs(out["csp"].item() - other.item()) > 1e-3


def test_costa_defaults_are_the_paper_settings():
    """§4.5.1: phrase 4-16, sentence 16-64, paragraph 64-128 tokens, 5 spans per level, Beta(4, 2), tau = 0.1,
    the MLM weight 0.1; the collator's own defaults agree with the head's options."""
    options = get_method("costa").options_from({})
    assert LEVELS == {"word": None, "phrase": (4, 16), "sentence": (16, 64), "paragraph": (64, 128)}
    assert (options.spans_per_level, options.span_alpha, options.span_beta) == (5, 4.0, 2.0)
    assert (options.temperature, options.mlm_weight, options.mlm_ratio) == (0.1, 0.1, 0.15)
    collator = COSTACollator.__dataclass_fields__
    assert [collator[k].default for k in ("spans_per_level", "span_alpha", "span_beta")] == [5, 4.0, 2.0]


@pytest.mark.parametrize("per_level", [5, 3])
def test_costa_span_count_per_level(wiki_samples, vocab, per_level):
    """§3.2: T spans for each of the 4 levels, 4T per text (T = 3 is §5.3's ablation), all present where the text
    has at least the level's minimum length; a stream pad sample gets none (it carries no target, docs/design.md)."""
    collate = COSTACollator(vocab, max_len=512, spans_per_level=per_level)
    samples = [dict(s, ids=s["ids"][:n]) for s, n in zip(wiki_samples, [3, 10, 20, 70, 510, 510])]
    batch = collate(samples + [dict(wiki_samples[6], pad=True)])
    bounds = batch["span_bounds"]
    assert bounds.shape == (len(samples) + 1, 4 * per_level, 2)
    for b, sample in enumerate(samples):
        tokens = len(sample["ids"])
        for level, span_range in enumerate(LEVELS.values()):
            present = bounds[b, level * per_level:(level + 1) * per_level, 0] >= 0
            fits = span_range is None or tokens >= span_range[0]
            assert bool(present.all()) == fits and bool(present.any()) == fits, (tokens, level)
    assert (bounds[-1] == -1).all()


def test_costa_span_starts_uniform(wiki_samples, vocab):
    """Eqs. 2-3: given its length l, a span's start is uniform over the n - l + 1 positions where it fits in the
    n ordinary tokens: on long texts the starts' positions in that range pass a KS test against U(0, 1), and on
    20-token texts the first and the last position each occur as often as sum 1 / (n - l + 1) predicts."""
    long = [s for s in wiki_samples if len(s["ids"]) >= 500]
    where = []
    for batch in _costa_batches(long, vocab, count=10):
        n = batch["attention_mask"].sum(1)[:, None] - 2
        b = batch["span_bounds"][:, 5:]  # phrase, sentence, paragraph
        start, length = b[..., 0], b[..., 1] - b[..., 0]
        where.append(((start - 1 + 0.5) / (n - length + 1)).flatten())
    x = np.sort(torch.cat(where).numpy())
    assert len(x) > 2000
    assert np.abs(np.arange(1, len(x) + 1) / len(x) - x).max() < 0.04  # KS at n > 2000: ~0.03

    short = [dict(s, ids=s["ids"][:20]) for s in wiki_samples]
    first = last = expected = 0.0
    for batch in _costa_batches(short, vocab, count=4):
        b = batch["span_bounds"][:, 5:15]  # phrase and sentence; a 20-token text has no paragraph
        start, end = b[..., 0], b[..., 1]
        assert (start >= 1).all() and (end <= 21).all()
        first += (start == 1).sum().item()
        last += (end == 21).sum().item()
        expected += (1.0 / (20 - (end - start) + 1)).sum().item()
    for count in (first, last):
        assert abs(count - expected) < 4 * expected ** 0.5, (count, expected)
