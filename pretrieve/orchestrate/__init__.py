"""The orchestrators: chains of applications run as jobs and child processes, above the applications they run.

`farm.py` (`pretrieve farm`: fine-tuning and evaluation jobs over checkpoints x datasets x stages),
`finetune_stages.py` (`pretrieve finetune-stages`: fine-tuning, mining and teacher scoring, chained),
`pretrain_runs.py` (pre-training runs as child processes, then their farm: what `scale run` and `study run` share)
and `scale_run.py` (`pretrieve scale run`: a study's points pre-trained, then handed to the farm). The method
studies of `pretrieve study` (pretrieve/study/) sit on this floor too.
"""
