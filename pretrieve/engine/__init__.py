"""Training engine: the DeepSpeed loop, checkpoints and resume (train.py)."""
