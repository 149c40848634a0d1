import sys

from pretrieve.engine.preemption import hold_stop_signals  # no torch: a stop signal is held from here on

hold_stop_signals(sys.argv[1:])

from pretrieve.cli import main  # noqa: E402

raise SystemExit(main())
