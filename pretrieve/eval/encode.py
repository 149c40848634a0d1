"""Dense encoding of texts with an exported encoder (a HF directory: `pretrieve export`, or any BERT-like model).

Texts are read a window at a time (`EncodeOptions.window`, default 64 batches): a window is tokenized in one
call, sorted by length and batched, so a batch pads only to its own longest text (on SciFact at 256 tokens this
skips most of the padding a corpus-order batch carries), and memory holds one window's tokens whatever the
corpus size; vectors come back in input order. A text's vector does not depend on its batch-mates except by
float rounding: on CPU, a batch of other lengths moves a few coordinates by one or two float32 ulps (about
1e-7, from how the matrix products are blocked), so two window sizes agree to that, and one window over all the
texts is the whole-list sort of earlier versions, bit for bit. Pooling: `cls` (the [CLS] vector, the RetroMAE
family), `mean` (over non-padding tokens, sentence-transformers), `last` (a decoder LLM's last real token) or
`llama2vec` (eval/prompt_pooling.py); `dim` keeps the pooled vector's first N coordinates (a Matryoshka model's
prefix, models/matryoshka.py), cut before `normalize`, so a cut cosine model's vectors are unit vectors again,
as sentence-transformers' `truncate_dim` scored by cosine; `normalize` makes inner product cosine. A query or passage prompt is put
before each text, as sentence-transformers' `prompt_name` does, and the maximum length counts it (as its
max_seq_length does): a prompt that leaves its text no token of its own is refused. bf16 autocast on a GPU,
fp32 on CPU. A CoT-MoTE encoder (an export with query experts) encodes queries through its query experts and
documents through its passage experts (the CoT-MoTE paper §3.3).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from pretrieve.eval.options import EncodeOptions
from pretrieve.eval.prompt_pooling import PromptPooling
from pretrieve.models.export import load_base_model
from pretrieve.models.poolings import PROMPT_POOLINGS, VOCAB_POOLINGS
from pretrieve.models.representation import POOLINGS

def length_sorted_batches(tokenizer, texts: Iterable[str], options: EncodeOptions, device: torch.device,
                          desc: str, progress: bool, total: int | None = None, tokenize=None):
    """(row indices into `texts`, padded batch on `device`): `texts` read window by window, each window
    tokenized in one call (`tokenize(window)`: the ids of each text; default the tokenizer's, cut to the
    maximum length) and batched longest texts first. `total`: the number of texts, for the progress line
    (default: len(texts) when it has one)."""
    from pretrieve.progress import Progress

    if total is None and hasattr(texts, "__len__"):
        total = len(texts)  # type: ignore[arg-type]
    stream, start, size = iter(texts), 0, options.batch_size
    with Progress(total, desc, unit="text", enabled=progress, leave=False) as shown:
        while window := list(islice(stream, options.window_size())):
            ids = (tokenize(window) if tokenize is not None
                   else tokenizer(window, truncation=True, max_length=options.max_length)["input_ids"])
            order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
            for first in range(0, len(order), size):
                rows = order[first:first + size]
                yield [start + i for i in rows], \
                    tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt").to(device)
                shown.update(len(rows))
            start += len(window)


class DenseEncoder:
    def __init__(self, model_dir: str | Path, options: EncodeOptions, device: str | None = None):
        from transformers import AutoTokenizer

        if options.pooling not in (*POOLINGS, *PROMPT_POOLINGS):
            raise ValueError(f"pooling: {options.pooling!r} is not one of {', '.join((*POOLINGS, *PROMPT_POOLINGS))}")
        if not Path(model_dir).is_dir():
            raise ValueError(f"{model_dir}: not a model directory (expected a HF export with config and tokenizer)")
        self.options, self.model_dir = options, str(Path(model_dir).resolve())
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompted = PromptPooling.of_export(model_dir) if options.pooling == "llama2vec" else None
        self.routed = has_query_experts(model_dir)
        if self.routed:
            from pretrieve.models.encoder import load_encoder

            self.model = load_encoder(model_dir).to(self.device).eval()
        else:  # as trained: a decoder LLM's attention and positions, an adapter kept apart folded in
            self.model = load_base_model(model_dir).to(self.device).eval()
        width = self.model.config.hidden_size
        if options.dim is not None and not 1 <= options.dim <= width:
            raise ValueError(f"--dim {options.dim}: {model_dir}'s vectors have {width} coordinates; give 1 to {width}")
        self.lengths = {queries: self._length(queries) for queries in (True, False)}

    def _length(self, queries: bool) -> int:
        added = (len(self.prompted.head) + len(self.prompted.suffixes[queries]) if self.prompted is not None
                 else len(self.tokenizer("")["input_ids"]))  # the special tokens; llama2vec's prompt rows
        return row_length(self.tokenizer, self.options, queries, added)

    def settings(self) -> dict:
        """What determines a document's vector."""
        return {"model": self.model_dir, "pooling": self.options.pooling, "max_length": self.options.max_length,
                "normalize": self.options.normalize,
                **({"passage_prompt": self.options.passage_prompt} if self.options.passage_prompt else {}),
                "dim": self.options.dim}  # None (all) also matches folders encoded before `dim` was recorded

    @property
    def dim(self) -> int:
        return self.options.dim or self.model.config.hidden_size

    def encode(self, texts: list[str], desc: str = "encode", progress: bool = True,
               queries: bool = False) -> np.ndarray:
        """[len(texts), hidden] float32 vectors, in the order of `texts`; `queries` picks the query experts."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for rows, vectors in self.vectors(texts, desc, progress, queries):
            out[rows] = vectors
        return out

    @torch.inference_mode()
    def vectors(self, texts: Iterable[str], desc: str = "encode", progress: bool = True, queries: bool = False,
                total: int | None = None) -> Iterator[tuple[list[int], np.ndarray]]:
        """(rows of `texts`, their float32 vectors) batch by batch, `texts` read one window at a time."""
        pool, tokenize = POOLINGS.get(self.options.pooling), None
        options = replace(self.options, max_length=self.lengths[queries])
        if self.prompted is not None:
            pool = self.prompted.pool
            tokenize = partial(self.prompted.tokenize, self.tokenizer, max_length=options.max_length, queries=queries)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        if self.options.query_prompt if queries else self.options.passage_prompt:
            total = len(texts) if total is None and hasattr(texts, "__len__") else total  # type: ignore[arg-type]
            texts = prompted(texts, self.options, queries)
        for rows, batch in length_sorted_batches(self.tokenizer, texts, options, self.device, desc, progress,
                                                 total, tokenize):
            with autocast:
                if self.routed:
                    text_type = torch.full((len(rows),), int(queries), dtype=torch.long, device=self.device)
                    hidden = self.model(batch["input_ids"], batch["attention_mask"], text_type=text_type)
                else:
                    hidden = self.model(**batch).last_hidden_state
            vectors = pool(hidden.float(), batch["attention_mask"])[:, :self.dim]
            if self.options.normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            yield rows, vectors.cpu().numpy()


def row_length(tokenizer, options: EncodeOptions, queries: bool, added: int) -> int:
    """The tokens a query's (or a passage's) row may have: max_length, which counts the prompt and the `added`
    tokens of the encoding, as sentence-transformers' max_seq_length does, or with `query_own_length` the query's
    own tokens after its prompt. A prompt that leaves its text no token is refused, before any text is read."""
    prompt = options.query_prompt if queries else options.passage_prompt
    prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0
    if queries and options.query_own_length is not None:
        return options.query_own_length + prompt_tokens
    check_room("query" if queries else "passage", options.max_length, prompt_tokens, added)
    return options.max_length


def prompted(texts: Iterable[str], options: EncodeOptions, queries: bool) -> Iterable[str]:
    """Each text after its query (or passage) prompt, as sentence-transformers' encode(..., prompt_name=...) puts
    it."""
    prompt = options.query_prompt if queries else options.passage_prompt
    return (prompt + text for text in texts) if prompt else texts


def check_room(kind: str, max_length: int, prompt_tokens: int, added: int) -> None:
    """A query or passage keeps at least one token of its own at `max_length`, after its prompt's `prompt_tokens`
    and the `added` tokens of the encoding (special tokens): else refused, naming the flags."""
    if max_length - prompt_tokens - added >= 1:
        return
    prompt = f"its prompt takes {prompt_tokens} tokens and " if prompt_tokens else ""
    shorter = (f", or shorten the {kind} prompt (--{kind}-prompt, else the model's sentence-transformers prompt "
               f"'{kind}')") if prompt_tokens else ""
    raise ValueError(f"max length {max_length} leaves a {kind} none of its own tokens: {prompt}the encoding adds "
                     f"{added}, and the max length counts them all (as sentence-transformers' max_seq_length does); "
                     f"give a --max-length above {prompt_tokens + added}{shorter}")


def has_query_experts(model_dir: str | Path) -> bool:
    from pretrieve.models.encoder import HEAD_WEIGHTS, open_weights

    path = Path(model_dir) / HEAD_WEIGHTS
    if not path.is_file():
        return False
    with open_weights(path) as f:
        return any(k.startswith("encoder.query_experts.") for k in f.keys())


class VocabEncoder:
    """Dense + vocabulary-sparse vectors from a model with an MLM head (a pretrieve export, a model fine-tuned
    by pretrieve, or a HF BERT with its MLM head).

    `dupmae`: eqs. (10)-(12) of RetroMAE-2 (ACL 2023) through models.representation's `load_joint`:
    for a model fine-tuned with pooling dupmae, its learned W^cls, LPU and k; for a DupMAE pre-training export,
    W^cls = identity at d' = hidden, else a fixed random orthogonal map, and mu_X the LPU logits max-pooled
    over the ordinary tokens (eq. 7). Documents keep their top_k entries (eq. 11's I_X; default: the trained
    k, else 384); queries keep every entry, as eq. (12) reads mu_q at the document's entries.
    `sparse`: SPLADE-style max over tokens of log(1 + relu(MLM logits)) (the CoT-MoTE paper eq. 4), no dense part,
    over the tokens between [CLS] and [SEP] unless the model's fine-tuning pooled those too
    (`models.representation.sparse_special_tokens`); `hybrid`: the [CLS] vector plus the sparse vector over
    every token (CoT-MoTE §3.3); documents keep top_k entries
    (default 256). The max over positions runs vocabulary chunk by vocabulary chunk
    (models.representation.splade_vectors, as fine-tuning with pooling sparse computes it): no
    [batch, length, 30,522] logits. A CoT-MoTE encoder reads queries through its query experts.
    """

    def __init__(self, model_dir: str | Path, options: EncodeOptions, top_k: int | None = None,
                 device: str | None = None):
        from transformers import AutoTokenizer

        from pretrieve.models.encoder import load_encoder
        from pretrieve.models.representation import load_joint, sparse_special_tokens

        pooling = options.pooling
        if pooling not in VOCAB_POOLINGS:
            raise ValueError(f"pooling: {pooling!r} is not one of {', '.join(VOCAB_POOLINGS)}")
        self.pooling, self.options = pooling, options
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.encoder = load_encoder(model_dir).to(self.device).eval()
        if any(line.startswith("MLM head") for line in self.encoder.load_report):
            raise ValueError(f"{model_dir}: pooling {pooling} needs the model's MLM head, and it has none")
        self.joint = load_joint(model_dir, self.encoder, ot_topk=top_k).eval() if pooling == "dupmae" else None
        self.top_k = self.joint.ot_topk if self.joint is not None else top_k or 256
        # sparse: over the text's own tokens unless the model was fine-tuned pooling [CLS] and [SEP] too; hybrid:
        # CoT-MoTE's eq. 4, every token
        self.special_tokens = pooling == "hybrid" or sparse_special_tokens(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        added = len(self.tokenizer("")["input_ids"])
        self.lengths = {queries: row_length(self.tokenizer, options, queries, added) for queries in (True, False)}

    @torch.inference_mode()
    def encode(self, texts: list[str], documents: bool, desc: str = "encode", progress: bool = True):
        """(dense [N, d] float32 or None, CSR [N, vocab] float32) in the order of `texts`; the CSR is assembled
        from each batch's rows, never a row at a time."""
        from scipy import sparse

        from pretrieve.models.representation import keep_top_k, splade_vectors

        encoder = self.encoder
        dense = None if self.pooling == "sparse" else np.empty(
            (len(texts), self.joint.cls_dim if self.joint is not None else encoder.config.hidden_size), np.float32)
        blocks, order = [], []
        options = replace(self.options, max_length=self.lengths[not documents])
        for picked, batch in length_sorted_batches(self.tokenizer, prompted(texts, options, not documents), options,
                                                   self.device, desc, progress, len(texts)):
            mask = batch["attention_mask"]
            text_type = None
            if encoder.query_experts is not None:
                text_type = torch.full((len(mask),), int(not documents), dtype=torch.long, device=self.device)
            hidden = encoder(batch["input_ids"], mask, text_type=text_type).float()
            if self.joint is not None:
                vectors = self.joint.vectors(encoder, hidden, mask, documents)
                cls, vocab = vectors[:, :self.joint.cls_dim], vectors[:, self.joint.cls_dim:]
            else:
                vocab = splade_vectors(encoder, hidden, mask, self.special_tokens)
                cls = hidden[:, 0]
                if documents:
                    vocab = keep_top_k(vocab, self.top_k)
            if dense is not None:
                dense[picked] = cls.cpu().numpy()
            blocks.append(sparse.csr_matrix(vocab.cpu().numpy()))
            order.extend(picked)
        if not blocks:
            return dense, sparse.csr_matrix((0, encoder.config.vocab_size), dtype=np.float32)
        return dense, sparse.vstack(blocks, format="csr")[np.argsort(order)]  # back into the order of `texts`
