"""`pretrieve <command>`: the command line. Each command parses its arguments and calls one module."""

from __future__ import annotations

import argparse
import faulthandler
import sys

from pretrieve import __version__
from pretrieve.commands import data, estimate, evaluation, finetune, scale, study, training
from pretrieve.engine.preemption import (INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Stopped, end_by_sigint_at_exit,
                                        hold_stop_signals)
from pretrieve.engine.process_exit import exit_before_teardown, leave_process_group
from pretrieve.utils.stop_signals import HEALTH_EXIT_CODES

# The commands in the order `pretrieve --help` lists them: each adds its parser and flags (the one place they are
# defined) and sets the function that runs it.
COMMANDS = (
    data.add_tokenizer, data.add_prepare, data.add_stream,
    training.add_pretrain, training.add_export, training.add_card, training.add_universal, training.add_launch_info,
    estimate.add_estimate,
    finetune.add_finetune, finetune.add_finetune_stages, finetune.add_mine, finetune.add_teacher_scores,
    evaluation.add_encode, evaluation.add_eval, evaluation.add_farm, evaluation.add_track, evaluation.add_report,
    scale.add_scale, study.add_study,
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a function, called only when help is shown: it may import the heavy
    parts (torch), which no other use of the command line should wait for."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def parser() -> argparse.ArgumentParser:
    """The `pretrieve` parser with every command's; building it imports no torch."""
    root = _Parser(prog="pretrieve", description=__doc__.splitlines()[0])
    root.add_argument("--version", action="version", version=f"pretrieve {__version__}")
    commands = root.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(commands)
    return root


def main(argv: list[str] | None = None) -> int:
    """Run `pretrieve ARGV`; without `argv`, this process's command line, and the process is the command's: a
    training command holds stop signals from here (engine/preemption.py; `python -m pretrieve` from its first
    line), and one that SIGINT stopped ends the process by SIGINT."""
    if argv is None:
        hold_stop_signals(sys.argv[1:])
        faulthandler.enable(all_threads=True)  # a crash in C++ (SIGSEGV, SIGABRT) shows each thread's Python stack
    root = parser()
    args = root.parse_args(argv)
    if args.command is None:
        root.print_help()
        return 2
    code = _run_command(args, own_process=argv is None)
    agreed = (0, PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE, *HEALTH_EXIT_CODES.values())  # every rank ends so
    if argv is None and code in agreed and leave_process_group():
        exit_before_teardown(code, by_sigint=code == INTERRUPTED_EXIT_CODE)  # a rank: engine/process_exit.py
    if argv is None and code == INTERRUPTED_EXIT_CODE:
        end_by_sigint_at_exit()  # as an interrupted program ends: a shell script running it stops too
    return code


def _run_command(args, own_process: bool) -> int:
    """Run the command; its errors and stops as one line each. `own_process`: the command is this process's
    (`pretrieve ...`): Ctrl-C outside a training loop ends it with a line too (a caller in this process, such as
    a test, keeps its KeyboardInterrupt)."""
    import os

    try:
        return args.run(args)
    except Stopped as stopped:  # a stop signal, with the work so far saved
        if stopped.every_rank or int(os.environ.get("RANK", 0)) == 0:
            print(f"pretrieve {args.command}: {stopped.line}", file=sys.stderr)
        return stopped.code
    except KeyboardInterrupt:
        if not own_process:
            raise
        print(f"pretrieve {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except (ValueError, RuntimeError, OSError) as e:  # our errors carry file/line/key; no traceback needed
        print(f"pretrieve {args.command}: error: {e}", file=sys.stderr)
        return 1
