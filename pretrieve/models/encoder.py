"""The shared encoder every head trains: a HF transformers base model of one backbone family (BERT, RoBERTa,
XLM-R, ModernBERT: models/backbones) plus the family's MLM head.

The MLM head (transform + output bias, output weights tied to the word embeddings, as in BERT) lives here
because several methods use it beyond MLM (RetroMAE's decoder predictions, DupMAE's OT projection). On a
decoder LLM it is the checkpoint's LM head: no transform, no bias, and its own output weights (`lm_head`) where
the config unties them from the word embeddings (backbones/causal_lm.py).
Logits are computed only where a loss needs them (`mlm_logits` takes any [..., hidden] selection), not over
the whole [B, L, vocab] grid.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pretrieve.models import unpadding
from pretrieve.models.backbones import UNPADDING, backbone_named, backbone_of
from pretrieve.models.backbones.base import TextTypes
from pretrieve.models.lora import LoraOptions, lora_options, merge_saved_adapter
from pretrieve.models.token_targets import Targets
from pretrieve.models.vocab_loss import vocab_cross_entropy

log = logging.getLogger(__name__)

HEAD_WEIGHTS = "pretrieve_head.safetensors"  # a head's extra weights beside an exported encoder
HEAD_CONFIG = "pretrieve_head.json"  # ... and the method and options that trained it
EXPORT_FORMAT = "pretrieve-export/1"  # HEAD_CONFIG's "format"
FINETUNE_META = "pretrieve_finetune.json"  # beside a fine-tuned export: what it is and how it pools
MODEL_PREFIX = "model."  # the exported base model's keys in an Encoder's state dict
TOKEN_HEAD = ("mlm_", "lm_head.")  # the token predictions' head in an Encoder's state dict (beside the embeddings)
_OLD_MODEL_PREFIX = "bert."  # ... in checkpoints written before backbones other than BERT


@dataclass
class ModelOptions:
    """The `model:` section of a config. With `init_from`, the architecture (backbone included) is the
    checkpoint's."""

    init_from: str | None = None  # local HF directory: a checkpoint of one of the backbones, or a pretrieve export
    backbone: str = "bert"  # bert | roberta | xlm-roberta | modernbert; decoder LLMs: llama | qwen2 | qwen3 | mistral
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512  # positions of a text (RoBERTa's table gets pad + 1 rows more)
    dropout: float = 0.1
    pad_token_id: int | None = None  # None: the training tokenizer's (set by the experiment), else the backbone's
    # with init_from: the positions of a text after growing the checkpoint's learnt position table, its new rows
    # copies of the old ones in order (Longformer's initialisation; BGE-M3 grew XLM-R's to 8,192 this way)
    extend_positions: int | None = None
    # pack each batch's texts into one row, no compute on padding (the encoder families; not decoder LLMs)
    unpad: bool = False
    # a decoder LLM family attending both ways, padding still hidden (LLM2Vec); with init_from too
    bidirectional: bool = False
    # LoRA adapters on the base model, whose own weights stay frozen (models/lora.py); r = 0: every weight trains
    lora: LoraOptions = field(default_factory=LoraOptions)
    # how vocabulary-projection losses are computed (models/vocab_loss.py): auto | chunked | plain | liger; the
    # same loss and gradients within float rounding, at different speeds and memory
    vocab_loss: str = "auto"

    def __post_init__(self):
        if self.lora is None:  # `lora: null`: none
            self.lora = LoraOptions()
        elif not isinstance(self.lora, LoraOptions):  # from a config file; its keys checked and named model.lora.KEY
            self.lora = lora_options(self.lora, "model.lora")

    def hf_config(self):
        """The HF config of a new model of this backbone."""
        backbone = backbone_named(self.backbone)
        pad = backbone.default_pad_token_id if self.pad_token_id is None else self.pad_token_id
        if not 0 <= pad < self.vocab_size:
            raise ValueError(f"model.pad_token_id: {pad} is outside the vocabulary of {self.vocab_size} tokens; "
                             "give the id of the tokenizer's pad token")
        return backbone.config(self, pad)


class Encoder(nn.Module):
    def __init__(self, config, model: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.backbone = backbone_of(config)
        self.model = model if model is not None else self.backbone.model_class(config, **self.backbone.model_kwargs)
        if self.backbone.has_pooler:  # kept, so that an export is a complete BertModel; pre-training never uses it
            self.model.pooler.requires_grad_(False)
        self.mlm_transform = self.backbone.mlm_transform(config)
        if self.backbone.mlm_bias:
            self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        else:
            self.register_parameter("mlm_bias", None)
        self.init_new(self.mlm_transform)
        # an untied LM head's output weights (a decoder LLM's *ForCausalLM `lm_head`); None: the word embeddings
        self.lm_head = self.backbone.output_projection(config)
        if self.lm_head is not None:
            self.init_new(self.lm_head)
        self.load_report: list[str] = []  # what init_from did not provide (and was initialised), and did not use
        self.query_experts: nn.ModuleList | None = None  # MoTE (the CoT-MoTE paper §3.1): see add_query_experts
        self.text_types = TextTypes()  # which texts of the running batch are queries, for the experts
        self.unpad = False  # see enable_unpadding
        self.vocab_loss = "auto"  # model.vocab_loss: the path of token_loss (models/vocab_loss.py)
        self.register_load_state_dict_pre_hook(_rename_old_keys)

    # rename_old_keys(state_dict, prefix): the load hook's renaming in place, also for a universal checkpoint's
    # per-parameter folders (engine/checkpoint.py)
    rename_old_keys = staticmethod(lambda state_dict, prefix: _rename_old_keys(None, state_dict, prefix))

    @classmethod
    def build(cls, options: ModelOptions) -> "Encoder":
        if options.init_from:
            encoder = cls.from_pretrained(options.init_from)
            if options.extend_positions:
                encoder.backbone.extend_positions(encoder.model, options.extend_positions)
        else:
            encoder = cls(options.hf_config())
        if options.bidirectional:  # recorded in the HF config, which an export saves (backbones/causal_lm.py)
            encoder.config.bidirectional = True
        if options.unpad:
            encoder.enable_unpadding()
        encoder.vocab_loss = options.vocab_loss
        return encoder

    @classmethod
    def from_config_file(cls, path: str | Path) -> "Encoder":
        """A new encoder of the architecture a config.json describes (its model_type names the backbone)."""
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(str(path), local_files_only=True))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Encoder":
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"init_from: {path} is not a HF model directory (no config.json)")
        check_weights(path)
        try:
            backbone = backbone_of(AutoConfig.from_pretrained(str(path), local_files_only=True))
        except ValueError as e:
            raise ValueError(f"init_from: {path}: {e}") from None
        with own_load_report():  # said below in pretrieve's words, the MLM head read, not "unexpected"
            model, info = backbone.model_class.from_pretrained(str(path), output_loading_info=True,
                                                               local_files_only=True, **backbone.model_kwargs)
        model = merge_saved_adapter(model, path)  # an export whose LoRA adapter was kept apart
        encoder = cls(model.config, model=model)
        report = [f"{key}: not in {path}, initialised" for key in sorted(info["missing_keys"])]
        # only the MLM head's tensors: from_pretrained above has read the rest already
        hf_keys = backbone.hf_mlm_keys
        hf_head = read_weights(path, prefixes=tuple(hf_keys))
        mapped = {key: new + key[len(old):] for key in hf_head for old, new in hf_keys.items() if key.startswith(old)}
        head = {mapped[key]: value for key, value in hf_head.items() if key in mapped}
        head.update({key[len("encoder."):]: value for key, value in read_weights(
            path, HEAD_WEIGHTS, prefixes=tuple(f"encoder.{name}" for name in TOKEN_HEAD)).items()})
        own = [name for name, _ in encoder.token_head_parameters()]
        missing = [k for k in own if k not in head]
        encoder.load_state_dict({k: v for k, v in head.items() if k in own}, strict=False)
        if missing:
            report.append(f"MLM head ({', '.join(missing)}): not in {path}, initialised")
        # what the checkpoint holds and nothing here takes: its heads for other tasks, a tied LM head's copy
        unused = sorted({key for key in info["unexpected_keys"] if key not in mapped}
                        | {key for key, name in mapped.items() if name not in own})
        report += [f"{key}: in {path}, not used" for key in unused]
        for line in report:
            log.warning("init_from %s", line)
        encoder.load_report = report
        return encoder

    def token_head_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of the token predictions' head beyond the word embeddings: the MLM transform and bias,
        or a decoder LLM's untied LM head."""
        return [(name, p) for name, p in self.named_parameters() if name.startswith(TOKEN_HEAD)]

    def init_new(self, module: nn.Module) -> None:
        """The backbone's initialisation (BERT's: normal(0, initializer_range), LayerNorm 1/0) for a module added
        to the encoder."""
        self.backbone.init_new(self.model, module)

    def enable_activation_checkpointing(self) -> None:
        """Recompute each encoder layer in backward instead of keeping its activations (HF checkpointing; the
        dropout RNG is replayed, so the numbers do not change)."""
        checkpoint_activations(self.model)

    def enable_unpadding(self) -> None:
        """Run the stack on each batch's texts packed into one row (model.unpad; models/unpadding.py). The states
        at real tokens equal the padded batch's; at padding they are zeros."""
        if not self.backbone.unpads:
            raise ValueError(f"model.unpad: the {self.backbone.display_name} backbone has no unpadded path "
                             f"({UNPADDING} have)")
        self.model.set_attn_implementation(unpadding.ATTENTION)
        self.unpad = True

    def add_query_experts(self) -> None:
        """Mixture-of-Textual-Experts (the CoT-MoTE paper §3.1, eqs. 7-9): every layer keeps its one self-attention
        and gets a second feed-forward block, the query expert (Q-FFN), initialised as a copy of the layer's
        FFN, which stays the passage expert (P-FFN). An expert is the whole block, its norm included (as
        VLMo's experts). Each sequence goes through the expert of its text type.

        The passage experts stay in the base model, so an export loads in `AutoModel` as the passage encoder;
        the query experts are head weights (`encoder.query_experts.*` in pretrieve_head.safetensors).
        """
        if self.query_experts is not None:
            return
        layers = self.backbone.layers(self.model)
        self.query_experts = nn.ModuleList(self.backbone.query_expert(layer) for layer in layers)
        for layer, expert in zip(layers, self.query_experts):
            self.backbone.route_feed_forward(layer, expert, self.text_types)

    @property
    def embeddings(self) -> nn.Module:
        """The embedding module: (input_ids= or inputs_embeds=) -> the first layer's input."""
        return self.model.embeddings

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def position_vectors(self, width: int, device: torch.device) -> torch.Tensor | None:
        """p_0 .. p_{width-1} [width, hidden] as the embedding module adds them; None for rotary positions."""
        return self.backbone.position_vectors(self.model, width, device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                text_type: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [B, L, hidden]. `text_type` [B] (1 = query, 0 = passage) picks each sequence's
        expert in a MoTE encoder; without it, or without experts, every sequence is a passage."""
        if text_type is not None and self.query_experts is None and bool(text_type.any()):
            raise ValueError("text_type asks for query experts, but this encoder has none (add_query_experts)")
        is_query = None if text_type is None or self.query_experts is None else text_type.bool()
        if not self.unpad:
            self.text_types.set(is_query)
            return self.backbone.forward(self.model, input_ids, attention_mask)
        packed = unpadding.Packed.of(attention_mask)
        # MoTE: each packed token goes through its text's expert
        self.text_types.set(None if is_query is None else packed.pack(is_query[:, None].expand_as(packed.real)))
        hidden = self.backbone.packed_forward(self.model, packed.pack(input_ids), packed, attention_mask)
        return packed.unpack(hidden)

    def forward_with_early(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(last hidden states, the states after the first `layer` layers), both [B, L, hidden], from one pass:
        Condenser's late and early representations. A forward hook on that layer reads them, so the padded,
        unpadded, checkpointed and compiled stacks all give them; it is removed before any backward, so a
        checkpointed layer's recomputation does not fire it."""
        layers = self.backbone.layers(self.model)
        if not 1 <= layer <= len(layers):
            raise ValueError(f"early layer {layer}: the encoder has layers 1..{len(layers)}")
        early = []
        handle = layers[layer - 1].register_forward_hook(
            lambda module, args, out: early.append(out[0] if isinstance(out, tuple) else out))
        try:
            last = self(input_ids, attention_mask)
        finally:
            handle.remove()
        states = early[0]
        return last, unpadding.Packed.of(attention_mask).unpack(states) if self.unpad else states

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the token predictions' output weights, an untied LM head's or the word embeddings."""
        return self.word_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits of BERT's MLM head (a decoder LLM's LM head) for hidden states [..., hidden]."""
        return F.linear(self.mlm_transform(hidden), self.output_weight, self.mlm_bias)

    def token_loss(self, hidden: torch.Tensor, targets: Targets | torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the MLM head over the targets (models/token_targets.py; labels [B, L] with -100
        where there is none), only their positions projected."""
        return masked_token_loss(hidden, targets, self.mlm_transform, self.output_weight, self.mlm_bias,
                                 self.vocab_loss)


def masked_token_loss(hidden: torch.Tensor, targets: Targets | torch.Tensor, transform, weight: torch.Tensor,
                      bias: torch.Tensor | None, vocab_loss: str) -> torch.Tensor:
    """Mean cross-entropy of an MLM head (`transform`, output `weight`, `bias`) over the real targets, only their
    positions projected: == F.cross_entropy(F.linear(transform(hidden[selected]), weight, bias), ...), by the
    path `vocab_loss` (model.vocab_loss) names. Given positions, it reads nothing of the device: index_select,
    not a boolean index (whose forward reads the mask for the states and the labels, and its backward once more),
    and the mean over real targets by ignore_index, so the padding entries of a fixed count add nothing."""
    if isinstance(targets, torch.Tensor):
        targets = Targets.of(targets)  # labels alone: the count read (a wait for the device on a GPU)
    if not targets.positions.numel():
        return hidden.sum() * 0.0  # nothing labelled: zero loss, graph kept
    states = hidden.flatten(0, -2).index_select(0, targets.positions)
    return vocab_cross_entropy(transform(states), weight, bias, targets.labels, vocab_loss)


def _rename_old_keys(module, state_dict, prefix, *args) -> None:
    """Checkpoints written before other backbones than BERT keep the base model under `bert.`."""
    for key in [k for k in state_dict if k.startswith(prefix + _OLD_MODEL_PREFIX)]:
        state_dict[prefix + MODEL_PREFIX + key[len(prefix + _OLD_MODEL_PREFIX):]] = state_dict.pop(key)


def checkpoint_activations(model) -> None:
    """Turn on HF activation checkpointing (non-reentrant) in a transformers model. transformers 5 renamed
    `gradient_checkpointing_enable` to `activation_checkpointing_enable` and deprecates the old name (gone in
    v6); the releases before the rename have only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def own_load_report():
    """transformers' load report (a warning table of the keys a checkpoint lacks or has beyond the model) left
    out, for a caller that reports them itself: an export's MLM head (models.export.save_base_model) is no
    surprise to pretrieve's loaders."""
    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        yield
    finally:
        report.setLevel(level)


def load_encoder(path: str | Path) -> Encoder:
    """The encoder of a HF model directory (of one of the backbones) or a pretrieve export, with its query
    experts when the export has them (a CoT-MoTE pre-training or fine-tuning run): what fine-tuning and encoding
    start from."""
    encoder = Encoder.from_pretrained(path)
    experts = read_weights(Path(path), HEAD_WEIGHTS, prefixes=("encoder.query_experts.",))
    if experts:
        encoder.add_query_experts()
        result = encoder.load_state_dict({k[len("encoder."):]: v for k, v in experts.items()}, strict=False)
        missing = [k for k in result.missing_keys if k.startswith("query_experts.")]
        if missing:
            raise ValueError(f"{path}: {HEAD_WEIGHTS} holds only some query experts (missing {missing[:3]})")
    return encoder


def export_meta(path: str | Path) -> dict:
    """The method and options of a pre-training export ({} for a directory that is not one)."""
    config = Path(path) / HEAD_CONFIG
    if not config.is_file():
        return {}
    meta = json.loads(config.read_text(encoding="utf-8"))
    if meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{config}: format {meta.get('format')!r}, expected {EXPORT_FORMAT!r}")
    return meta


def finetune_meta(path: str | Path) -> dict:
    """What a fine-tuned export records about its training (pooling, normalisation, ...); {} for other models."""
    file = Path(path) / FINETUNE_META
    return json.loads(file.read_text()) if file.is_file() else {}


def ordinary_positions(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, L]: positions 1 .. length-2, the ordinary tokens between [CLS] and [SEP] (data.masking's twin)."""
    pos = torch.arange(width, device=lengths.device)
    return (pos >= 1) & (pos < (lengths[:, None] - 1))


def read_weights(path: Path, name: str | None = None,
                 prefixes: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a HF model directory (all *.safetensors, else pytorch_model.bin), or of one named file;
    with `prefixes`, only the keys starting with one of them are read from safetensors files."""
    def load(file: Path) -> dict[str, torch.Tensor]:
        with open_weights(file) as f:
            return {k: f.get_tensor(k) for k in f.keys() if prefixes is None or k.startswith(prefixes)}

    if name is not None:
        file = path / name
        return load(file) if file.is_file() else {}
    files = sorted(f for f in path.glob("*.safetensors") if f.name != HEAD_WEIGHTS)
    if files:
        return {k: v for f in files for k, v in load(f).items()}
    legacy = path / "pytorch_model.bin"
    return torch.load(legacy, map_location="cpu", weights_only=True) if legacy.is_file() else {}


def open_weights(file: Path):
    """safe_open(file) (a context manager); a file safetensors cannot read, cut short by an interrupted copy say,
    is an error naming it, where safetensors' own names none."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); export or copy it again") from e


def check_weights(path: str | Path) -> None:
    """Every safetensors file of the model directory `path` readable (open_weights): called before transformers
    loads one, whose error would not name the file."""
    for file in sorted(Path(path).glob("*.safetensors")):
        with open_weights(file):
            pass


def token_head_missing(path: str | Path) -> list[str]:
    """The token head's parameters (Encoder.token_head_parameters) the model directory `path` does not hold, as
    Encoder.from_pretrained would report them, from the weights' names alone (an untied LM head is large)."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    hf_keys = backbone_of(config).hf_mlm_keys
    keys = {}  # file name -> its tensors' names
    for file in sorted(path.glob("*.safetensors")):
        with open_weights(file) as f:
            keys[file.name] = list(f.keys())
    if not set(keys) - {HEAD_WEIGHTS}:  # the base model in pytorch_model.bin, read whole
        keys["pytorch_model.bin"] = list(read_weights(path))
    names = {key[len("encoder."):] for key in keys.pop(HEAD_WEIGHTS, [])}
    names |= {new + key[len(old):] for held in keys.values() for key in held for old, new in hf_keys.items()
              if key.startswith(old)}
    with torch.device("meta"):  # the parameters' names, no memory
        own = Encoder(config).token_head_parameters()
    return [name for name, _ in own if name not in names]
