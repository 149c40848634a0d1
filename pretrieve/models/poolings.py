"""The names of the representations pretrieve scores texts with, written once and light (no torch): the command
line offers them as choices before anything heavy is imported.

Implemented by: `cls` / `mean` / `last` in models/representation.py (POOLINGS), `dupmae` (DupMAE's eq. 12) by its
JointRepresentation, `sparse` by its splade_vectors, and at evaluation `sparse` / `hybrid` / `dupmae` by
eval/encode.py's VocabEncoder.
"""

DENSE_POOLINGS = ("cls", "mean", "last")  # one vector pooled from the token states (last: decoder LLMs' last
# real token); those a model's config can name
PROMPT_POOLINGS = ("llama2vec",)  # a dense vector read after a prompt appended to each text (eval/prompt_pooling.py)
VOCAB_POOLINGS = ("dupmae", "sparse", "hybrid")  # through the MLM head's vocabulary: pretrieve's own
DUAL_POOLINGS = (*DENSE_POOLINGS, "dupmae", "sparse")  # those the fine-tuned dual encoder trains and mining
# searches with
EVAL_POOLINGS = (*DENSE_POOLINGS, *PROMPT_POOLINGS, *VOCAB_POOLINGS)  # those `pretrieve eval` scores with
