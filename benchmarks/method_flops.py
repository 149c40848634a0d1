"""Training FLOPs of each method's micro-batch at BERT-base (engine.flops), as a multiple of mlm's on the same texts.

    python -m benchmarks.method_flops [--methods mlm retromae bow condenser cocondenser simlm lexmae]
        [--out benchmarks/results/method_flops.json]

The texts: the first 8 blocks of 510 tokens of the bundled Wikipedia sample (prepared at 512 tokens, read in
order), collated by each method's collator at its defaults and max_len 144 and 512, counted for a BERT-base
config; nothing is built or run. A coCondenser micro-batch holds two spans a document against mlm's whole texts.
simlm's count trains its generator too (a new one); `simlm, generator frozen` takes off the backward of the
generator's pass over the encoder's text, which a loaded, frozen generator of the same shape does not take. Prints the JSON it writes to --out: per length, each method's ratio to mlm's (mlm first).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from itertools import islice
from pathlib import Path

from transformers import BertConfig

from pretrieve.data.masking import Vocabulary
from pretrieve.data.prepare import PrepareOptions, prepare
from pretrieve.data.stream import ShardStream
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
from pretrieve.engine.flops import train_flops
from pretrieve.models.heads import get_method
from pretrieve.models.heads.simlm import generator_pass_flops

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("mlm", "retromae", "bow", "condenser", "cocondenser", "simlm", "lexmae")
TEXTS, LENGTHS = 8, (144, 512)


def full_length_texts(count: int = TEXTS) -> list[dict]:
    """The first `count` stream samples of 510 tokens (full 512-token blocks) of the bundled Wikipedia sample."""
    with tempfile.TemporaryDirectory() as work:
        prepare(PrepareOptions(source="wikipedia", inputs=[str(ROOT / "pretrieve/assets/samples/wikipedia")],
                               out=work, workers=0, max_len=512, progress=False))
        samples = islice(iter(ShardStream([Path(work) / "manifest.json"], seed=0, shuffle_buffer=1)), 400)
        return [s for s in samples if len(s["ids"]) >= 510][:count]


def flops_against_mlm(texts: list[dict], names: tuple[str, ...] = METHODS) -> dict:
    """Training FLOPs of a micro-batch of `texts` at BERT-base for each of `names` (mlm first), against mlm's."""
    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    config, result = BertConfig(), {"texts": len(texts)}
    for length in LENGTHS:
        flops = {}
        for name in names:
            spec = get_method(name)
            options = spec.options_from({"max_len": length})
            batch = spec.collator.from_options(options, vocab)(texts)
            flops[name] = train_flops(spec, options, config, batch)
            if name == "simlm":  # frozen (a loaded generator of the new one's shape): the encoder text's pass
                # takes no backward either
                options = replace(options, freeze_generator=False)
                flops["simlm, generator frozen"] = (flops["simlm"]
                                                    - 2 * generator_pass_flops(options, config, batch, "enc"))
        result[f"L{length}"] = {k: round(v / flops["mlm"], 3) for k, v in flops.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="mlm and the methods to count against it")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "method_flops.json")
    args = parser.parse_args()
    if args.methods[0] != "mlm":
        parser.error("--methods: mlm first (the others are counted against it)")
    result = flops_against_mlm(full_length_texts(), tuple(args.methods))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
