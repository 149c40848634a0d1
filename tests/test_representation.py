"""DupMAE's joint representation (eqs. 10-12) and the dense poolings against direct computations."""

import torch

from pretrieve.models.poolings import DENSE_POOLINGS
from pretrieve.models.representation import POOLINGS, JointRepresentation, cls_pooling, joint_scores, mean_pooling


def _inputs(seed=0, batch=3, width=9, hidden=16, vocab=50):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(batch, width, hidden, generator=g, dtype=torch.float64)
    lengths = torch.tensor([width, width - 2, 5])[:batch]
    mask = (torch.arange(width) < lengths[:, None]).long()
    lpu_weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    return states, mask, lengths, (lambda h: h @ lpu_weight.T)


def test_joint_representation_matches_direct_computation():
    states, mask, lengths, lpu = _inputs()
    rep = JointRepresentation(hidden_size=16, cls_dim=8, ot_topk=5).double()
    out = rep(states, mask, lpu)
    for b in range(3):
        ordinary = range(1, int(lengths[b]) - 1)  # no [CLS], [SEP] or padding
        mu = torch.stack([lpu(states[b, i]) for i in ordinary]).max(dim=0).values
        assert torch.allclose(out.ot_full[b], mu)
        top = sorted(range(50), key=lambda v: -mu[v].item())[:5]
        assert out.ot_indices[b].tolist() == top
        assert torch.allclose(out.ot_values[b], mu[top])
        assert torch.allclose(out.dense[b], rep.cls_proj.weight @ states[b, 0])

    scores = joint_scores(out, out)
    for q in range(3):
        for d in range(3):
            direct = out.dense[q] @ out.dense[d] + sum(out.ot_full[q, i] * out.ot_full[d, i]
                                                       for i in out.ot_indices[d].tolist())
            assert torch.allclose(scores[q, d], direct)


def test_projection_defaults():
    assert torch.equal(JointRepresentation(16, cls_dim=16).cls_proj.weight, torch.eye(16))
    w = JointRepresentation(16, cls_dim=8).cls_proj.weight  # orthonormal rows: a random rotation, then a cut
    assert torch.allclose(w @ w.T, torch.eye(8), atol=1e-6)
    variant = JointRepresentation(768, cls_dim=384, ot_topk=260)  # Table 4's "CLS:384, OT:260"
    assert variant.cls_proj.weight.shape == (384, 768) and variant.ot_topk == 260


def test_dense_poolings():
    states, mask, lengths, _ = _inputs()
    assert torch.equal(cls_pooling(states, mask), states[:, 0])
    for b in range(3):
        assert torch.allclose(mean_pooling(states, mask)[b], states[b, :int(lengths[b])].mean(dim=0))


def test_the_dense_poolings_are_those_named():
    """The command line offers models.poolings' names without importing torch: each is implemented here."""
    assert tuple(POOLINGS) == DENSE_POOLINGS
