"""A corpus's sparse vocabulary vectors (pooling `sparse`: SPLADE / LexMAE), encoded while the corpus streams past.

`encode_sparse_corpus` reads the (id, text) stream once, DEFAULT_SHARD_SIZE documents at a time, as dense
`encode_corpus` does (eval.vectors): memory holds one part's texts and rows while it is encoded, and the CSR
parts kept so far, never the corpus's texts. A document keeps its top_k entries (VocabEncoder), so
the parts take at most top_k x 8 bytes a document (float32 weight + int32 term): 256 entries over MS MARCO's
8.8M passages are 18 GB, below the 27 GB of its 768-d float32 dense vectors, and a FLOPS-regularised model
keeps far fewer. eval.search.sparse_search searches the parts one at a time through each part's inverted index.
"""

from __future__ import annotations

from itertools import chain, count, islice
from typing import Iterable, Iterator

import numpy as np

from pretrieve.eval.vectors import DEFAULT_SHARD_SIZE


class SparseVectors:
    """Corpus rows as consecutive CSR [n_i, vocab] parts addressed by global row; `ids[row]` is its document."""

    def __init__(self, parts: list, ids: list[str]):
        self.parts, self.ids = parts, ids
        self.starts = np.cumsum([0, *(p.shape[0] for p in parts)])
        if self.starts[-1] != len(ids):
            raise ValueError(f"{len(ids)} ids for {self.starts[-1]} sparse vectors")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, rows):
        """CSR [len(rows), vocab] of those global rows, in their order (eval.search.pair_scorer)."""
        from scipy import sparse

        rows = np.asarray(rows, dtype=np.int64)
        part_of = np.searchsorted(self.starts, rows, side="right") - 1
        pieces, positions = [], []
        for part in np.unique(part_of):
            chosen = np.nonzero(part_of == part)[0]
            pieces.append(self.parts[part][rows[chosen] - self.starts[part]])
            positions.append(chosen)
        if not pieces:
            return sparse.csr_matrix((0, self.parts[0].shape[1]), dtype=np.float32)
        return sparse.vstack(pieces, format="csr")[np.argsort(np.concatenate(positions))]

    def blocks(self) -> Iterator[tuple[int, object]]:
        """(global row of its first document, the CSR part), in row order."""
        yield from zip((int(s) for s in self.starts), self.parts)

    def stacked(self):
        """One CSR [D, vocab] of every row (hybrid scoring over a corpus that fits)."""
        from scipy import sparse

        return self.parts[0] if len(self.parts) == 1 else sparse.vstack(self.parts, format="csr")


def encode_sparse_corpus(encoder, documents: Iterable[tuple[str, str]], progress: bool = True,
                         shard_size: int = DEFAULT_SHARD_SIZE) -> SparseVectors:
    """The documents' sparse vectors (`encoder`: an eval.encode.VocabEncoder), the stream read once, a part per
    `shard_size` documents."""
    parts, ids, stream = [], [], iter(documents)
    for number in count():
        first = next(stream, None)
        if first is None:
            break
        shard = list(chain([first], islice(stream, shard_size - 1)))
        ids.extend(doc_id for doc_id, _ in shard)
        _, weights = encoder.encode([text for _, text in shard], documents=True, desc=f"encode part {number}",
                                    progress=progress)
        parts.append(weights)
    if not parts:
        raise ValueError("the corpus has no documents")
    return SparseVectors(parts, ids)
