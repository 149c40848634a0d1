"""The labelled positions of a token loss as the collators hand them (data/collators.py, `labelled_positions`):
beside labels `<key>` [B, L] (-100: no target), `<key>_positions` [N], flat indices into [B * L] in row-major
order, and `<key>_targets` [N], the labels there. N is fixed per batch (per run under train.static_shapes), its
padding entries pointing at position 0 with target -100, as NVIDIA's BERT pads to `max_predictions_per_seq`.

A token loss gathers the states there by index_select and takes F.cross_entropy's mean over the real targets by
ignore_index: neither needs the count on the host, so no step waits for the device. Labels alone ([B, L], from
a collator that does not emit positions, or a head that cuts its batch in chunks) are still taken: the
positions are found on the device by `nonzero`, one read of the count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrieve.data.collators import POSITIONS, TARGETS

IGNORE = -100  # no target (F.cross_entropy's ignore_index, the collators' "no label")


@dataclass(frozen=True)
class Targets:
    """A token loss's targets: the states at `positions` [N] of the flattened [B * L] predict `labels` [N]."""

    positions: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, labels: torch.Tensor) -> Targets:
        """From labels [..., L] alone: the positions found by `nonzero` (a read of the count)."""
        index = (labels != IGNORE).flatten().nonzero().squeeze(1)
        return cls(index, labels.flatten().index_select(0, index))

    def shifted(self, width: int) -> Targets:
        """The same targets predicted from the state one position before (token i from the state at i - 1, on
        rows of `width` positions): a target at a row's first position has no state before it and is left out."""
        first = self.positions % width == 0
        return Targets(torch.where(first, 0, self.positions - 1), torch.where(first, IGNORE, self.labels))


def token_targets(batch: dict, key: str) -> Targets:
    """The targets of labels `key` in `batch`: its labelled positions where the collator gave them."""
    positions = batch.get(key + POSITIONS)
    if positions is None:
        return Targets.of(batch[key])
    return Targets(positions, batch[key + TARGETS])
