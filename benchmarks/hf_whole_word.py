"""HF's whole-word draw as the official collators run it (standard library only): the official RetroMAE collator
of benchmarks/collators.py, the speed baseline of pretrieve's, calls it, and tests/test_masking.py compares
pretrieve's draw with it."""

from __future__ import annotations

import random


def hf_whole_word_mask(tokens: list[str], ratio: float, skip=("[CLS]", "[SEP]"), draw=random) -> list[int]:
    """0/1 per token: HF's `DataCollatorForWholeWordMask._whole_word_mask` (transformers 4.x), which the official
    collators call or copy: the tokens but `skip` in words ("##" pieces join the word before), the words shuffled
    by `draw`, each taken while it fits round(ratio x tokens), one that would overflow skipped."""
    words = []
    for i, token in enumerate(tokens):
        if token in skip:
            continue
        if words and token.startswith("##"):
            words[-1].append(i)
        else:
            words.append([i])
    draw.shuffle(words)
    budget = max(1, round(len(tokens) * ratio))
    covered: set[int] = set()
    for word in words:
        if len(covered) >= budget:
            break
        if len(covered) + len(word) > budget:
            continue
        covered.update(word)
    return [1 if i in covered else 0 for i in range(len(tokens))]
