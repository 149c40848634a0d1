"""Matryoshka representation learning (Kusupati et al. 2022, "Matryoshka Representation Learning", §3 eq. 1):
the loss summed over nested prefixes of the representation, so that its first m coordinates are a
representation on their own for every m of a set M.

    L_MRL = sum_{m in M} c_m * L(z_{1:m})

z_{1:m} is the vector's first m coordinates, re-normalised when the method scores with cosine similarity (a
prefix of a unit vector is not one); c_m are the weights (default 1 each). With a contrastive loss, L is the whole
InfoNCE of the batch recomputed on the prefixes (its candidates, masks and temperature alike), as
sentence-transformers' MatryoshkaLoss does; the representations are encoded once, so GradCache and the
cross-rank gather see one set of full-width vectors and one backward. A retrieval model trained so is searched
at any m by cutting its vectors (`pretrieve eval --dim m`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Matryoshka:
    """`matryoshka_dims: [...]` (and `matryoshka_weights: [...]`, one per dimension): the prefixes trained."""

    dims: tuple[int, ...]
    weights: tuple[float, ...]

    @property
    def widest(self) -> int:
        return max(self.dims)


def matryoshka_of(dims, weights, where: str) -> Matryoshka | None:
    """The Matryoshka setting of section `where` (None: off); a ValueError names the key."""
    if dims is None:
        if weights is not None:
            raise ValueError(f"{where}.matryoshka_weights: given without {where}.matryoshka_dims")
        return None
    if not isinstance(dims, (list, tuple)) or not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                                                              for d in dims):
        raise ValueError(f"{where}.matryoshka_dims: expected a list of dimensions >= 1 (e.g. [768, 256, 64]), "
                         f"got {dims!r}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"{where}.matryoshka_dims: {list(dims)} names a dimension twice")
    if weights is None:
        weights = [1.0] * len(dims)
    if not isinstance(weights, (list, tuple)) or len(weights) != len(dims):
        raise ValueError(f"{where}.matryoshka_weights: one weight per dimension of {where}.matryoshka_dims "
                         f"({len(dims)}), got {weights!r}")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0 for w in weights):
        raise ValueError(f"{where}.matryoshka_weights: must be numbers > 0, got {list(weights)}")
    return Matryoshka(tuple(int(d) for d in dims), tuple(float(w) for w in weights))


def check_width(matryoshka: Matryoshka | None, width: int, where: str) -> None:
    """A ValueError when a dimension is wider than the representation (`width` coordinates)."""
    if matryoshka is not None and matryoshka.widest > width:
        raise ValueError(f"{where}.matryoshka_dims: {matryoshka.widest} is wider than the representation "
                         f"({width} coordinates)")


def prefix(vectors: torch.Tensor, dim: int, normalize: bool) -> torch.Tensor:
    """The first `dim` coordinates of `vectors` [..., d], L2-normalised again when `normalize`."""
    cut = vectors[..., :dim]
    return F.normalize(cut, dim=-1) if normalize else cut


def matryoshka_loss(loss_of: Callable[..., dict[str, torch.Tensor]], vectors: list[torch.Tensor],
                    matryoshka: Matryoshka, normalize: bool) -> dict[str, torch.Tensor]:
    """sum_m c_m * loss_of(prefixes of `vectors` at m)["loss"] as "loss", each dimension's own loss as
    "loss@<m>" (detached), and the other parts `loss_of` returns (accuracy, counts) at the widest dimension."""
    total, parts = None, {}
    for dim, weight in zip(matryoshka.dims, matryoshka.weights):
        out = loss_of(*(prefix(v, dim, normalize) for v in vectors))
        total = weight * out["loss"] if total is None else total + weight * out["loss"]
        parts[f"loss@{dim}"] = out["loss"].detach()
        if dim == matryoshka.widest:
            parts.update({k: v for k, v in out.items() if k != "loss"})
    return {"loss": total, **parts}
