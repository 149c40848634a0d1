"""The three fine-tuning stages end to end in one process, on tiny models and the bundled samples (CPU).

    python tests/finetune_stages.py OUT

OUT/pretrained: a tiny random CoT-MoTE export (query experts); stage 1 (in-batch contrastive, eq. 13) on the
SciFact sample's judged queries; `mine` with the stage-1 model; stage 2 (hard + in-batch negatives, eq. 14);
the cross-encoder teacher on the mined groups; `teacher-scores`; stage 3 (distillation, eq. 15); SEED's
triplet loss on the bundled FlagEmbedding JSON lines. Each run leaves OUT/<name>/metrics.jsonl and export/;
OUT/losses.json holds each stage's loss over its first epoch of batches (dropout off) before and after.
"""

import json
import sys
from pathlib import Path

SAMPLES = Path(__file__).resolve().parent.parent / "pretrieve" / "assets" / "samples"
SCIFACT = SAMPLES / "beir" / "scifact-sample"
FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "finetune" / "tiny.yaml"


def main(out: Path) -> None:
    import torch

    from pretrieve.cli import main as cli
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export
    from pretrieve.models.heads import get_method

    torch.manual_seed(0)
    method = get_method("cotmote")
    export(method.build(method.options_from({"max_len": 64}),
                        ModelOptions(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256)),
           out / "pretrained")

    losses = {}

    def finetune(name: str, *overrides: str) -> None:
        code = cli(["finetune", str(CONFIG), f"run_dir={out / name}", *overrides])
        assert code == 0, f"finetune {name}: exit {code}"
        losses[name] = epoch_losses(out / name)

    finetune("stage1", f"finetune.init_from={out / 'pretrained'}", f"finetune.beir={SCIFACT}", "finetune.split=test",
             "finetune.negatives=0")
    assert cli(["mine", "--model", str(out / "stage1" / "export"), "--beir", str(SCIFACT), "--split", "test",
                "--depth", "30", "--negatives", "3", "--out", str(out / "hard.jsonl")]) == 0
    finetune("stage2", f"finetune.init_from={out / 'stage1' / 'export'}", f"finetune.data=[{out / 'hard.jsonl'}]")
    finetune("teacher", f"finetune.init_from={out / 'pretrained'}", f"finetune.data=[{out / 'hard.jsonl'}]",
             "finetune.model=cross")
    assert cli(["teacher-scores", "--model", str(out / "teacher" / "export"), "--data", str(out / "hard.jsonl"),
                "--out", str(out / "distill.jsonl")]) == 0
    finetune("stage3", f"finetune.init_from={out / 'stage2' / 'export'}", f"finetune.data=[{out / 'distill.jsonl'}]",
             "finetune.loss=distill")
    finetune("triplet", f"finetune.init_from={out / 'pretrained'}", f"finetune.data=[{FLAG}]", "finetune.loss=triplet",
             "finetune.normalize=true", "finetune.passage_max_len=64", "train.micro_batch_size=2")
    (out / "losses.json").write_text(json.dumps(losses, indent=1))
    print(json.dumps(losses))


def epoch_losses(run_dir: Path) -> dict:
    """The run's loss over the batches of its first epoch, with the initial weights and with the export."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pretrieve.config import _section
    from pretrieve.engine.export_checkpoint import load_checkpoint_weights
    from pretrieve.finetune.batches import GroupLoader, PairLoader
    from pretrieve.finetune.run import FinetuneOptions, build_model, load_examples

    raw = OmegaConf.load(run_dir / "config.yaml")
    o = _section(raw, "finetune", FinetuneOptions)
    loader = (GroupLoader if o.model == "dual" else PairLoader)(
        load_examples(o), AutoTokenizer.from_pretrained(o.init_from), raw.train.micro_batch_size, o.negatives,
        o.query_max_len, o.passage_max_len, raw.seed, teacher_scores=o.loss == "distill" and o.model == "dual")
    batches = list(loader)
    result = {}
    for when in ("before", "after"):
        model = build_model(o).eval()
        if when == "after":
            load_checkpoint_weights(model, run_dir / "checkpoints", (run_dir / "checkpoints" / "latest").read_text())
        with torch.no_grad():
            result[when] = sum(float(model(b)["loss"]) for b in batches) / len(batches)
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]))
