"""`llama2vec`, `ebae`, `ebar`: Llama2Vec's retrieval-oriented adaptation of a decoder LLM (Li, Liu, Xiao, Shao,
Lian; ACL 2024, arXiv 2312.15503, §3), following its released code, LLARA (FlagEmbedding research/LLARA,
pretrain/modeling.py and data.py). The paper trains one end token's state with a bag-of-words softmax over
every target token and nothing else; the code, followed here, differs (k tokens, max-pooled logits, distinct
targets without stop words, / 10, the next-token loss added): docs/methods.md, "The paper and LLARA's code".

The LLM reads a text followed by two prompts (data/llama2vec.py has the layout), each ending in k = 8 special
tokens whose states are the text's embedding:
- EBAE (embedding-based auto-encoding): after "summarize the above passage within eight words:", the
  embedding must predict the text's own words;
- EBAR (embedding-based auto-regression): after "predict the following passage within eight words:", the
  words of the text that follows.
EBAR's prompt does not attend to EBAE's and takes its positions (LLARA's mask and position ids), so both read
the text alone, as if each were the only prompt.

Each task's loss: the LM head's logits at its k special states, max-pooled over the k positions, then
log-softmax over the vocabulary; minus the mean log-probability of the distinct words of its target (stop
words and punctuation left out), averaged over the texts that have any, times `bow_scale` (LLARA divides by
10). `llama2vec` averages the two tasks' losses over the tasks with a target in the batch (LLARA's: a batch
whose EBAR bags are all empty trains EBAE alone, at full weight). The text's own next-token loss is added
(`lm_weight`, 1 as in LLARA), which keeps the LLM a language model while its prompts learn to summarise. The
logits are the checkpoint's LM head's, untied or tied, with no bias (backbones/causal_lm.py).

The retrieval embedding is the mean of the k special states of one prompt, normalised (LLARA's usage: passages
with the summarise prompt, queries with the predict one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrieve.data.llama2vec import PAD, PREDICT, SUMMARY, TASKS, Llama2VecCollator
from pretrieve.models.flops import vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class Llama2VecOptions(MethodOptions):
    max_len: int = option(128, at_least=64, why="the text and both prompts, about 40 tokens")  # LLARA's cutoff_len
    tasks: str = option("both", choices=TASKS)
    prompt_tokens: int = option(8, at_least=1, at_most=8, why="the llm tokenizer reserves 2 x 8")
    summary_prompt: str = '", summarize the above passage within eight words: '  # LLARA's, after the text
    predict_prompt: str = '", predict the following passage within eight words: '
    bow_scale: float = option(0.1, above=0)  # LLARA: each bag-of-words loss / 10
    lm_weight: float = option(1.0, at_least=0)  # LLARA: + the text's next-token loss


@dataclass
class EBAEOptions(Llama2VecOptions):
    tasks: str = option("ebae", choices=("ebae",))


@dataclass
class EBAROptions(Llama2VecOptions):
    tasks: str = option("ebar", choices=("ebar",))


class Llama2VecHead(PretrainingHead):
    """L = lm_weight L_lm + mean over the tasks with targets of L_task (module docstring); a decoder LLM,
    causal."""

    decoder_llms = "causal"  # LLARA's mask is causal but where it hides EBAE's prompt from EBAR's

    def forward(self, batch):
        hidden = self.encoder.backbone.masked_forward(self.encoder.model, batch["input_ids"],
                                                      prompt_mask(batch["segments"]), batch["position_ids"])
        # token i from the state at i - 1
        lm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels").shifted(hidden.shape[1]))
        out = {"lm": lm.detach()}
        tasks = [task for task in ("ebae", "ebar") if f"{task}_slots" in batch]
        trained = []  # per task, whether any text of the batch has a target (a tensor: no host read)
        for task in tasks:
            out[task] = self.bag_of_words_loss(hidden, batch[f"{task}_slots"], batch[f"{task}_targets"])
            trained.append((batch[f"{task}_targets"] >= 0).any())
        bow = sum(out[task] for task in tasks) / torch.stack(trained).sum().clamp(min=1)
        out["loss"] = self.options.lm_weight * lm + bow
        for task in tasks:
            out[task] = out[task].detach()
        return out

    def bag_of_words_loss(self, hidden: torch.Tensor, slots: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """bow_scale x the mean over texts with targets of -mean_{w in bag} log softmax(max_k logits_k)[w]."""
        states = hidden.gather(1, slots[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, k, h]
        # max, not amax: a tie (a word whose output row is zero) sends its gradient to one position, as LLARA's
        logp = self.encoder.mlm_logits(states).float().max(dim=1).values.log_softmax(dim=-1)  # [B, V]
        present = targets >= 0
        picked = logp.gather(1, targets.clamp(min=0)) * present
        per_text = -picked.sum(dim=1) / present.sum(dim=1).clamp(min=1)  # 0 for a text with no target (a pad)
        texts = present.any(dim=1).sum().clamp(min=1)  # no host read: nothing waits for the device
        return self.options.bow_scale * per_text.sum() / texts


class EBAEHead(Llama2VecHead):
    """EBAE alone (its own class: an export names its method by the head's class)."""


class EBARHead(Llama2VecHead):
    """EBAR alone."""


def prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """bool [B, L, L]: causal over real tokens, but EBAR's prompt rows do not see EBAE's prompt; a padding row
    sees itself only (a row with nothing to attend to would give NaN)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    visible = causal & (segments != PAD)[:, None, :]
    visible &= ~((segments == PREDICT)[:, :, None] & (segments == SUMMARY)[:, None, :])
    return visible | torch.eye(length, dtype=torch.bool, device=segments.device)


def prompt_flops(options, config, batch) -> int:
    """The LM head at every prompt's special states (the text's next-token loss is the encoder's MLM head)."""
    return vocab_flops(config, sum(batch[key].numel() for key in batch if key.endswith("_slots")))


for _name, _head, _options in (("llama2vec", Llama2VecHead, Llama2VecOptions), ("ebae", EBAEHead, EBAEOptions),
                               ("ebar", EBARHead, EBAROptions)):
    register_method(_name, _head, Llama2VecCollator, _options, flops=prompt_flops)
