"""One optimizer step of each given method at each given ZeRO stage, in one process (one rank of torchrun when
launched by it), so DeepSpeed's import and process group are paid once. Prints one JSON line per run on rank 0:
the step count, the first and last logged losses, and how many trainable encoder tensors the steps changed.

    python tests/one_step.py OUT MANIFEST retromae,dupmae,finetune 0,2,3 [fp32|bf16 [KEY=VALUE ...]]

A stage that is not a number names a file of ds_configs/ (cpu_test, zero3_offload) to train with instead.
`finetune` is stage 1 of fine-tuning (configs/finetune/tiny.yaml: in-batch negatives, gathered from every
rank) of the HF BERT directory in $FINETUNE_INIT on the bundled SciFact sample's test queries.
"""

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from pretrieve.config import load_config
from pretrieve.finetune.config import finetune_experiment
from pretrieve.finetune.run import finetune
from pretrieve.models.export import load_base_model
from pretrieve.pretrain import train
from pretrieve.pretrain_config import experiment

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "pretrain"
SCIFACT = ROOT / "pretrieve" / "assets" / "samples" / "beir" / "scifact-sample"


def main(out: str, manifest: str, methods: str, stages: str, precision: str = "fp32", *overrides: str) -> None:
    import os

    world = int(os.environ.get("WORLD_SIZE", 1))
    for method in methods.split(","):
        for stage in stages.split(","):
            run_dir = Path(out) / f"{method}-zero{stage}"
            ds = f"ds_configs/{stage}.json" if not stage.isdigit() else None
            common = [f"run_dir={run_dir}", "train.max_steps=3", "train.log_every=1", "train.micro_batch_size=4",
                      f"train.zero_stage={stage}" if ds is None else f"train.ds_config={ROOT / ds}",
                      "tracking.enabled=false", "train.warmup_ratio=0",  # the peak lr from step 1
                      f"train.precision={precision}", *overrides]
            if method == "finetune":
                initial = load_file(Path(os.environ["FINETUNE_INIT"]) / "model.safetensors")
                config = load_config(ROOT / "configs" / "finetune" / "tiny.yaml", [
                    *common, f"finetune.init_from={os.environ['FINETUNE_INIT']}", f"finetune.beir={SCIFACT}",
                    "finetune.split=test", "finetune.negatives=0"], required=("finetune",))
                result = finetune(finetune_experiment(config, world_size=world))
            else:
                config = load_config(CONFIGS / f"tiny-{method}.yaml", [
                    *common, f"data.manifests=[{manifest}]", "data.weights=null", "method.max_len=64"])
                exp = experiment(config, world_size=world)
                initial = {k: v.clone() for k, v in exp.method.build(exp.options, exp.model, seed=exp.seed)
                           .encoder.model.state_dict().items()}
                result = train(exp)
            if int(os.environ.get("RANK", 0)) != 0:
                continue
            trained = load_base_model(run_dir / "export").state_dict()  # the file holds the MLM head beside it
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            trainable = [k for k in trained if not k.startswith("pooler.")]  # the pooler is frozen
            changed = sum(not torch.equal(trained[k], initial[k]) for k in trainable)
            print(json.dumps({"method": method, "stage": int(stage) if ds is None else stage, "world": world,
                              "precision": precision, "step": result["step"], "first_loss": records[0]["loss"],
                              "loss": records[-1]["loss"], "finite": math.isfinite(records[-1]["loss"]),
                              "trainable": len(trainable), "changed": changed}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
