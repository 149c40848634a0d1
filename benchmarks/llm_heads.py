"""Every decoder-LLM head on every decoder family through `pretrieve pretrain`: the tiny-model results of the
decoder-LLM work (docs/methods.md, "Decoder LLMs").

    python -m benchmarks.llm_heads [--steps 20] [--work DIR] [--out benchmarks/results/llm_heads.json]

The heads `llama2vec`, `ebae`, `ebar` (tiny-llama2vec.yaml), `mntp` (tiny-mntp.yaml, bidirectional) and
`contrastive` (tiny-contrastive.yaml, last-token pooling, on pair shards) on Llama, Qwen2, Qwen3 and Mistral, plus
`llama2vec` with LoRA r 4 on each family. Each run starts from its family's `init_from` export (hidden 32, two
layers, an llm-kind tokenizer trained here on the bundled Wikipedia sample) with weight decay off, so that a
weight moves only where a gradient reached it. `ebar` on Llama runs with activation checkpointing.

Per run: the mean loss of the first and of the last quarter of the steps (each step reads other texts) and
the parts it logs; the export's method; of the exported base model's
weights, how many moved (all of them: every weight trains) or, for the LoRA runs (adapter kept apart), how
many are bit-identical to init_from's (all of them: LoRA leaves them frozen); the export's family and pooling.
`ok` says whether the run did all of that. The runs share one process (DeepSpeed imported once).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
CONFIGS = ROOT / "configs" / "pretrain"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
HEADS = {"llama2vec": "tiny-llama2vec.yaml", "ebae": "tiny-llama2vec.yaml", "ebar": "tiny-llama2vec.yaml",
         "mntp": "tiny-mntp.yaml", "contrastive": "tiny-contrastive.yaml"}
LOGGED = {"step", "loss", "lr", "grad_norm"}  # beside each head's own parts
THROUGHPUT = {"mfu", "padding_fraction", "samples_per_s", "tflops_per_device", "tokens_per_s"}


def inputs(work: Path) -> dict:
    """The llm-kind tokenizer, the text shards and the pair shards (SciFact's sample), each made once."""
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    tokenizer, text, pairs = work / "tokenizer", work / "text", work / "pairs"
    if not (tokenizer / "tokenizer.json").is_file():
        train_tokenizer(TokenizerTrainOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")],
                                              out=str(tokenizer), kind="llm", vocab_size=4000, progress=False))
    for out, options in ((text, dict(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], max_len=128)),
                         (pairs, dict(source="beir", inputs=[str(SAMPLES / "beir" / "scifact-sample")], pairs=True,
                                      qrels_split="test", max_len=64))):
        if not (out / "manifest.json").is_file():
            prepare(PrepareOptions(out=str(out), tokenizer=str(tokenizer), workers=0, progress=False, **options))
    return {"tokenizer": tokenizer, "text": text / "manifest.json", "pairs": pairs / "manifest.json"}


def init_exports(work: Path, tokenizer: Path) -> dict[str, Path]:
    """A tiny random model of each family, exported: every run of that family starts from it."""
    from pretrieve.data.masking import Vocabulary
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export
    from pretrieve.models.heads import get_method

    vocab = Vocabulary.of_tokenizer(tokenizer)
    method = get_method("contrastive")
    out = {}
    for family in FAMILIES:
        out[family] = work / "init" / family
        if not (out[family] / "config.json").is_file():
            model = ModelOptions(backbone=family, vocab_size=vocab.size, hidden_size=32, num_layers=2, num_heads=2,
                                 intermediate_size=64, pad_token_id=vocab.pad_id, dropout=0.0)
            export(method.build(method.options_from({"pooling": "last", "max_len": 128}), model, seed=0),
                   out[family], tokenizer=tokenizer)
    return out


def runs(work: Path, data: dict, init: dict[str, Path], steps: int) -> dict[str, tuple[str, list[str]]]:
    """{name: (config, overrides)}: every head on every family, and llama2vec with LoRA on each."""
    out = {}
    for family in FAMILIES:
        for head, config in [*HEADS.items(), ("llama2vec-lora", HEADS["llama2vec"])]:
            name = f"{head}-{family}"
            overrides = [f"run_dir={work / 'runs' / name}", f"model.init_from={init[family]}",
                         f"model.backbone={family}", f"data.tokenizer={data['tokenizer']}",
                         f"data.manifests=[{data['pairs' if head == 'contrastive' else 'text']}]",
                         f"train.max_steps={steps}", "train.log_every=1", "train.weight_decay=0", "train.lr=1e-3",
                         "train.micro_batch_size=8", f"checkpoint.every={steps}", "tracking.enabled=false"]
            overrides.append(f"method.name={head.removesuffix('-lora')}")
            if head == "llama2vec-lora":  # at 10x the rate: the adapters start at B = 0
                overrides += ["model.lora.r=4", "model.lora.keep_adapter=true", "train.lr=1e-2"]
            overrides.append("method.max_len=64" if head == "contrastive" else "method.max_len=96")
            if head == "contrastive":
                overrides.append("method.pooling=last")
            if (head, family) == ("ebar", "llama"):
                overrides.append("train.activation_checkpointing=true")
            out[name] = (str(CONFIGS / config), overrides)
    return out


def check(run_dir: Path, init: Path, family: str, method: str, lora: bool) -> dict:
    """What one finished run shows (see the module docstring)."""
    import torch
    from safetensors.torch import load_file

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    quarter = max(1, len(losses) // 4)  # each step has other texts: the first and last quarter's means compared
    first, last = sum(losses[:quarter]) / quarter, sum(losses[-quarter:]) / quarter
    export = run_dir / "export"
    before, after = load_file(init / "model.safetensors"), load_file(export / "model.safetensors")
    same = [key for key in before if key in after and torch.equal(before[key], after[key])]
    pooling = json.loads((export / "1_Pooling" / "config.json").read_text())
    result = {"loss_first_quarter": round(first, 4), "loss_last_quarter": round(last, 4),
              "steps": records[-1]["step"], "parts": sorted(set(records[0]) - LOGGED - THROUGHPUT),
              "base_weights": len(before), "moved": len(before) - len(same),
              "family": json.loads((export / "config.json").read_text())["model_type"],
              "method": json.loads((export / "pretrieve_head.json").read_text())["method"],
              "last_token_pooling": bool(pooling.get("pooling_mode_lasttoken"))}
    moved_right = (len(same) == len(before) and (export / "adapter").is_dir()) if lora else not same
    result["ok"] = (last < first and moved_right and after.keys() == before.keys()
                    and (result["family"], result["method"]) == (family, method) and result["last_token_pooling"])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
    p.add_argument("--work", type=Path, default=ROOT / "bench-out" / "llm-heads", help="data, exports and runs")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "llm_heads.json")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from pretrieve.config import load_config
    from pretrieve.pretrain import train
    from pretrieve.pretrain_config import experiment
    from pretrieve.utils.run_dir import write_atomic

    args.work.mkdir(parents=True, exist_ok=True)
    data = inputs(args.work)
    init = init_exports(args.work, data["tokenizer"])
    results, start = {}, time.time()
    for name, (config, overrides) in runs(args.work, data, init, args.steps).items():
        method, family, lora = name.split("-")[0], name.rsplit("-", 1)[1], "-lora-" in name
        run_dir = args.work / "runs" / name
        try:
            if not (run_dir / "export" / "config.json").is_file():
                train(experiment(load_config(config, overrides)))
            results[name] = check(run_dir, init[family], family, method, lora)
        except Exception as error:  # one broken pairing is a result too; the others still run
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        print(f"llm_heads: {name}: {results[name]}", file=sys.stderr, flush=True)
    record = {"benchmark": "llm_heads", "steps": args.steps, "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "seconds": round(time.time() - start, 1),
              "all_ok": all(r["ok"] for r in results.values()), "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(record, indent=1) + "\n")
    print(f"llm_heads: {sum(r['ok'] for r in results.values())} of {len(results)} runs ok; wrote {args.out}",
          file=sys.stderr)
    return 0 if record["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
