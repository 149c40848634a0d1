"""Train several runs of one config in one process (DeepSpeed's import paid once), one after the other.

    python tests/train_many.py CONFIG '[["run_dir=a", "train.max_steps=4"], ["run_dir=b", ...]]'
"""

import json
import sys

from pretrieve.config import load_config
from pretrieve.pretrain import train
from pretrieve.pretrain_config import experiment

if __name__ == "__main__":
    config, runs = sys.argv[1], json.loads(sys.argv[2])
    for overrides in runs:
        train(experiment(load_config(config, overrides)))
