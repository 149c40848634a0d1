"""`pretrieve export CHECKPOINT OUT`: a training checkpoint as an HF directory plus the head's weights.

CHECKPOINT is a run directory (its latest checkpoint), its checkpoints/ directory, or one tag directory.
The head is rebuilt from the run's config.yaml and encoder_config.json; ZeRO 1-3 partitions are consolidated
with DeepSpeed's zero_to_fp32, a ZeRO-0 checkpoint is read directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrieve.utils.run_dir import locate

ENCODER_CONFIG = "encoder_config.json"


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    from transformers import BertConfig

    from pretrieve.config import load_config, method_options
    from pretrieve.models.encoder import Encoder
    from pretrieve.models.export import export
    from pretrieve.eval.model_card import write_model_card

    run_dir, ckpt_dir, tag = locate(Path(path))
    method, options = method_options(load_config(run_dir / "config.yaml"))
    head = method.head(Encoder(BertConfig.from_json_file(run_dir / ENCODER_CONFIG)), options)
    load_checkpoint_weights(head, ckpt_dir, tag)
    return export(head, out, before_rename=lambda tmp: write_model_card(out, run_dir, tag, card_dir=tmp))


def load_checkpoint_weights(module: torch.nn.Module, ckpt_dir: Path, tag: str) -> None:
    """Load the weights of checkpoint `tag` into `module` (the trained module, rebuilt): ZeRO 1-3 partitions
    consolidated in fp32, a ZeRO-0 checkpoint read directly."""
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"{tag_dir}: checkpoint tag missing")
    module_file = tag_dir / "mp_rank_00_model_states.pt"  # ZeRO 0-2 (ZeRO 3 writes one per rank, partitioned)
    states = torch.load(module_file, map_location="cpu", weights_only=False)["module"] if module_file.is_file() else {}
    state = states
    if any(tag_dir.glob("*optim_states.pt")):  # ZeRO 1-3: consolidate the fp32 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        # ZeRO 1 leaves frozen weights (the pooler) out of the consolidated dict; the module states hold them
        expected = module.state_dict()
        for key, value in states.items():
            if key not in state and key in expected and value.shape == expected[key].shape:
                state[key] = value
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids") and not k.endswith("token_type_ids")]
    if missing or unexpected:
        raise ValueError(f"{tag_dir}: checkpoint does not match the run's model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
