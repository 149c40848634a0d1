"""`simlm`: SimLM (Wang et al., ACL 2023, arXiv 2207.02578 §3.1, eqs. 1-2): a representation bottleneck trained
by replaced language modelling. Equation numbers are the ACL 2023 text's; where the paper leaves a detail open
(which tokens are targets, the generator's loss weight) the code follows the released code (microsoft/unilm
`simlm/src/models/rlm.py`, `collators/rlm_collator.py`, `scripts/train_rlm.sh`), which docs/methods.md compares.

A small MLM generator, a second model inside this head, fills the masked positions of the encoder's input and,
drawn again independently, those of the decoder's more heavily masked input with tokens sampled from its
predictions. The encoder reads its replaced text and predicts the original token at every position; a shallow
decoder reads the encoder's [CLS] state in place of its own first token, then its replaced text, and predicts the
original tokens again: all it knows of the positions the generator changed comes through that one vector.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from pretrieve.data.collators import MLMCollator, covering_mask
from pretrieve.data.masking import ordinary_positions
from pretrieve.models.encoder import Encoder
from pretrieve.models.flops import encoder_flops, labelled, layer_flops, vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import BottleneckDecoderOptions, Decoder, masked_attention
from pretrieve.models.heads.registry import option, register_method
from pretrieve.models.token_targets import token_targets

DECODER_INITS = ("copy", "new")


@dataclass
class SimLMOptions(BottleneckDecoderOptions):
    # "copy": the decoder starts as a copy of the encoder's last layers (the released code's deepcopy); "new":
    # initialised as the backbone initialises new modules
    decoder_init: str = option("copy", choices=DECODER_INITS)
    # a local HF directory of an MLM model of one of the backbones, sharing the encoder's tokenizer (released:
    # google/electra-base-generator, whose ELECTRA family is no backbone here); None: a new generator of the
    # encoder's family, `generator_size` of its width
    generator_init: str | None = None
    generator_size: float = option(1 / 3, above=0, at_most=1)  # ELECTRA-base's generator: 256 of 768, 4 heads
    # None: frozen when loaded from generator_init (the released --rlm_freeze_generator True), trained with the
    # encoder when new (a frozen untrained generator would sample noise, and is refused)
    freeze_generator: bool | None = None
    generator_weight: float = option(0.2, at_least=0)  # its MLM loss in the total when trained (released 0.2)


@dataclass
class SimLMCollator(MLMCollator):
    """SimLM batches: `input_ids` with [MASK] at every masked position (the released recipe's
    all_use_mask_token: the generator, not the collator, puts other tokens there), `attention_mask`, `mlm_labels`
    (the original token at the encoder's masked positions: where the generator samples, and its MLM target), plus
    `dec_input_ids` ([MASK] at the decoder's masked positions), `dec_masked` (bool [B, L], those positions) and
    `rlm_labels` (the original token at every ordinary position, the tokenizer's special tokens left out: the
    target of both the encoder and the decoder), and `replace_seed` [1], the seed of the generator's draws, drawn
    with the masks: a batch's replacements are a pure function of its samples, as its masks are.

    The decoder's mask holds the encoder's and adds whole words drawn independently at the rate that makes the
    union cover `decoder_mask_ratio` of the tokens in expectation, (d - e) / (1 - e), as the released collator
    does; a decoder ratio at or below the encoder's masks the decoder where the encoder is masked."""

    mlm_ratio: float = 0.30
    decoder_mask_ratio: float = 0.50
    token_losses: ClassVar[tuple[str, ...]] = ("rlm_labels",)  # the generator's MLM loss is its own
    corruption: ClassVar[tuple[float, float]] = (1.0, 0.0)
    budget_counts_cls_sep: ClassVar[bool] = True

    def extend(self, out, batch, words, num_words, rng):
        dec_masked = covering_mask(out, batch, words, num_words, self.budget_tokens(batch), self.mlm_ratio,
                                   self.decoder_mask_ratio, rng)
        targets = ordinary_positions(batch.lengths, batch.ids.shape[1]) & ~self.vocab.special[batch.ids]
        targets[batch.pad] = False
        out["dec_input_ids"] = torch.from_numpy(np.where(dec_masked, self.vocab.mask_id, batch.ids))
        out["dec_masked"] = torch.from_numpy(dec_masked)
        out["rlm_labels"] = torch.from_numpy(np.where(targets, batch.ids, -100))
        out["replace_seed"] = torch.from_numpy(rng.integers(0, 2**62, size=1))


def generator_config(options: SimLMOptions, encoder_config):
    """The generator's HF config: generator_init's, or the encoder's narrowed to `generator_size` of its width
    (whole attention heads of the encoder's head size, the FFN in proportion), its depth kept as ELECTRA's."""
    if options.generator_init is not None:
        return _saved_config(options.generator_init)
    config = copy.deepcopy(encoder_config)
    head_size = config.hidden_size // config.num_attention_heads
    heads = max(1, round(config.hidden_size * options.generator_size / head_size))
    config.hidden_size, config.num_attention_heads = heads * head_size, heads
    config.intermediate_size = max(1, round(config.intermediate_size * heads / encoder_config.num_attention_heads))
    return config


@functools.lru_cache(maxsize=8)
def _saved_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def generator_frozen(options: SimLMOptions) -> bool:
    """Whether the generator is frozen: `freeze_generator`, or by default whether it is loaded (generator_init)."""
    if options.freeze_generator is None:
        return options.generator_init is not None
    if options.freeze_generator and options.generator_init is None:
        raise ValueError("method.freeze_generator: a frozen generator needs method.generator_init (a trained MLM "
                         "model's directory); a new generator must learn: set freeze_generator to false or null")
    return options.freeze_generator


class SimLMHead(PretrainingHead):
    """L_pt = L_enc + L_dec (§3.1, after eq. 2), + generator_weight x L_gen when the generator trains (the
    released `ReplaceLM`; the paper freezes it and names no weight).

    Eq. 1, x_enc = Sample(g, Mask(x, p_enc)), x_dec = Sample(g, Mask(x, p_dec)): at the masked positions M of a
    [MASK]ed text, x'_i ~ softmax(G(x_masked)_i) for i in M, x'_i = x_i elsewhere (the padding token never
    drawn); two draws from two maskings, the decoder's covering the encoder's, no gradient through the sampling.
    Eq. 2, L_enc = -(1/|T|) sum_{i in T} log p(x_i | Enc(x_enc)_i), through the encoder's MLM head: the paper
    sums over every position of x; T here is the text's ordinary tokens (special tokens and padding left out, as
    the released labels), all of them, not only M: replaced language modelling.
    L_dec ("similarly", §3.1) = -(1/|T|) sum_{i in T} log p(x_i | Dec([h_cls; e(x_dec_1..n)])_i): `decoder_layers`
    layers of the encoder's family with full (bidirectional) self-attention over the text (padding hidden),
    position 0 the encoder's last [CLS] state h_cls, the rest the decoder text's embeddings; the same MLM head.
    Both are token means over the batch, as the released cross-entropies. L_gen = the generator's own MLM loss
    at the encoder's masked positions (its decoder-side draw has no gradient, as released).
    """

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.generator_frozen = generator_frozen(options)
        if options.generator_init is not None:
            self.generator = Encoder.from_pretrained(options.generator_init)
            if self.generator.config.vocab_size != encoder.config.vocab_size:
                raise ValueError(f"method.generator_init: {options.generator_init} predicts "
                                 f"{self.generator.config.vocab_size} tokens, the encoder {encoder.config.vocab_size}: "
                                 "the generator must share the encoder's tokenizer")
        else:
            self.generator = Encoder(generator_config(options, encoder.config))
        self.generator.vocab_loss = encoder.vocab_loss
        pad = encoder.config.pad_token_id  # the token never drawn (none when the config names none)
        self.register_buffer("pad_id", torch.tensor([] if pad is None else [pad], dtype=torch.long), persistent=False)
        if self.generator_frozen:
            self.generator.requires_grad_(False)
        self.decoder = Decoder(encoder, num_layers=options.decoder_layers)
        if options.decoder_init == "copy":
            self.copy_last_layers(encoder)

    def resolved_options(self):
        from dataclasses import replace  # the module's; this class's `replace` draws tokens

        return replace(self.options, freeze_generator=self.generator_frozen)

    def copy_last_layers(self, encoder) -> None:
        layers = encoder.backbone.layers(encoder.model)
        if len(layers) < len(self.decoder.layers):
            raise ValueError(f"method.decoder_layers: {len(self.decoder.layers)} layers cannot be copied from an "
                             f"encoder of {len(layers)} (decoder_init: new starts them fresh)")
        for target, source in zip(self.decoder.layers, layers[len(layers) - len(self.decoder.layers):]):
            # every weight of the decoder layer from its encoder layer; ModernBERT's decoder layer, like its first
            # layer, has no attention norm (its inputs are normalised already), so the copied layer's is left
            own = target.state_dict()
            target.load_state_dict({k: v for k, v in source.state_dict().items() if k in own})

    def train(self, mode: bool = True):
        """A frozen generator stays in eval mode (no dropout), as the released code means it to (its trainer's
        `model.train()` undoes that there)."""
        super().train(mode)
        if self.generator_frozen:
            self.generator.eval()
        return self

    def forward(self, batch):
        attention_mask, mlm_labels = batch["attention_mask"], batch["mlm_labels"]
        masked = mlm_labels != -100
        draws = torch.Generator(mlm_labels.device).manual_seed(int(batch["replace_seed"][0]))
        # eq. 1: x_enc and x_dec, two draws of the generator at the two maskings
        enc_ids, gen = self.replace(batch["input_ids"], attention_mask, masked, draws, mlm_labels)
        dec_ids, _ = self.replace(batch["dec_input_ids"], attention_mask, batch["dec_masked"], draws)
        hidden = self.encoder(enc_ids, attention_mask)
        enc = self.encoder.token_loss(hidden, token_targets(batch, "rlm_labels"))  # eq. 2, L_enc
        # the decoder reads h_cls in place of its own [CLS] embedding: the bottleneck (§3.1)
        states = torch.cat([hidden[:, :1], self.encoder.embeddings(input_ids=dec_ids)[:, 1:]], dim=1)
        width = attention_mask.shape[1]
        visible = attention_mask.bool()[:, None, :].expand(-1, width, -1)  # padding hidden, as in the encoder
        # L_dec, eq. 2's form over the decoder's output
        dec = self.encoder.token_loss(self.decoder(states, None, masked_attention(visible)),
                                      token_targets(batch, "rlm_labels"))
        # L_pt = L_enc + L_dec (§3.1); a generator that trains adds its weighted MLM loss, as released
        loss = enc + dec if self.generator_frozen else enc + dec + self.options.generator_weight * gen
        replaced = (masked & (enc_ids != mlm_labels)).sum() / masked.sum().clamp(min=1)
        return {"loss": loss, "enc": enc.detach(), "dec": dec.detach(), "gen": gen.detach(),
                "replaced": replaced.float()}

    def replace(self, ids: torch.Tensor, attention_mask: torch.Tensor, masked: torch.Tensor,
                draws: torch.Generator, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids with a generator sample at each `masked` position, drawn from `draws`: eq. 1's Sample(g, .), the
        generator's MLM loss there against `labels`, the original tokens). Given labels and a generator that
        trains, the loss takes gradients; without labels (the decoder's text) nothing does. The draws never touch
        torch's global random state: the batch's seed fixes them, at every ZeRO stage, padded or unpadded, in
        validation and after a resume."""
        with torch.set_grad_enabled(labels is not None and not self.generator_frozen and torch.is_grad_enabled()):
            hidden = self.generator(ids, attention_mask)
            logits = self.generator.mlm_logits(hidden[masked])  # [masked positions, vocab]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16's softmax is too coarse
            if not bool(masked.any()):  # a batch of stream pad samples: nothing to fill
                return ids, hidden.sum() * 0.0
            loss = F.cross_entropy(logits, labels[masked]) if labels is not None else logits.sum() * 0.0
        with torch.no_grad():
            # never the padding token: a text holds it only as padding (RoBERTa counts positions past it)
            probabilities = torch.softmax(logits.index_fill(-1, self.pad_id, float("-inf")), dim=-1)
            sampled = torch.multinomial(probabilities, 1, generator=draws).squeeze(-1)
        return ids.masked_scatter(masked, sampled), loss


def simlm_flops(options: SimLMOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The generator on both texts (its MLM head at the positions it fills), the encoder's MLM head at the
    positions beyond the masked ones (the encoder's own count has those), the decoder's layers over the whole
    text and its MLM head at every target."""
    b, length = batch["input_ids"].shape
    targets = labelled(batch["rlm_labels"])
    return (generator_pass_flops(options, config, batch, "enc") + generator_pass_flops(options, config, batch, "dec")
            + vocab_flops(config, targets) - vocab_flops(config, labelled(batch["mlm_labels"]))
            + options.decoder_layers * layer_flops(config, b, length, length) + vocab_flops(config, targets))


def generator_pass_flops(options: SimLMOptions, config, batch: dict[str, torch.Tensor], text: str) -> int:
    """One generator pass over the encoder's (`enc`) or the decoder's (`dec`) text."""
    ids = batch["input_ids"] if text == "enc" else batch["dec_input_ids"]
    positions = batch["mlm_labels"] if text == "enc" else torch.where(batch["dec_masked"], ids, -100)
    return encoder_flops(generator_config(options, config), {"input_ids": ids, "mlm_labels": positions})


def simlm_no_backward_flops(options: SimLMOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The generator's passes that take no gradient: both when it is frozen, the decoder text's when it trains."""
    frozen = generator_frozen(options)
    return (generator_pass_flops(options, config, batch, "dec")
            + (generator_pass_flops(options, config, batch, "enc") if frozen else 0))


register_method("simlm", SimLMHead, SimLMCollator, SimLMOptions, flops=simlm_flops,
                no_backward_flops=simlm_no_backward_flops, eval_pooling="cls", study_arm=10)
