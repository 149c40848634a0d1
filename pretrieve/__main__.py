import sys

if sys.argv[1:2] in (["pretrain"], ["finetune"]):  # a training process: a preemption signal from now on is held
    from pretrieve.engine.preemption import hold_stop_signals

    hold_stop_signals()

from pretrieve.cli import main  # noqa: E402

raise SystemExit(main())
