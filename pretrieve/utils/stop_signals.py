"""The signals that stop a run and the exit statuses that say how it stopped: one table for the trainer
(engine/preemption.py), its data workers, the commands that run others (farm, scale run, finetune-stages) and the
SLURM launcher, which requeues on PREEMPTED_EXIT_CODE and RETRY_EXIT_CODE (never on a health alarm's code)."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SLURM's two, and Ctrl-C
PREEMPTED_EXIT_CODE = 85  # the SLURM launcher requeues on this code
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130: what a shell reports for a process that SIGINT ended
RETRY_EXIT_CODE = 86  # start-up failed for a reason that may pass: the launcher requeues, a bounded number of times
# a health alarm set to stop ended the run (engine/health.py, train.health): never requeued, the run is broken
HEALTH_EXIT_CODES = {"nonfinite": 87, "collapse": 88, "zero_grad_norm": 89, "zero_lr": 90}
