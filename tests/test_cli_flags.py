"""Every command's flags as recorded in tests/data/cli_flags.json: name, default, type, choices, nargs, required,
action and mutually exclusive groups, for every command and subcommand of `pretrieve`. A change to a flag fails
here; when the change is meant, write the record again and commit it with the change:

    python tests/test_cli_flags.py    # rewrites tests/data/cli_flags.json from the command line as it is
"""

import argparse
import json
import sys
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "data" / "cli_flags.json"
# a type is recorded by what it makes of these (int, at_least(1), a mixture weight, float, str tell apart)
PROBES = ("-1", "0", "1", "299", "300", "1.5", "inf", "x")


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def root_parser() -> argparse.ArgumentParser:
    """The parser `pretrieve` builds, caught as `main` hands it the arguments (however the command line builds
    it)."""
    from pretrieve import cli

    def catch(self, *args, **kwargs):
        raise _Built(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        cli.main([])
    except _Built as built:
        return built.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("pretrieve.cli.main built no parser")


def type_record(kind) -> dict | None:
    if kind is None:
        return None
    made = {}
    for probe in PROBES:
        try:
            made[probe] = repr(kind(probe))
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            made[probe] = "refused"
    return {"name": getattr(kind, "__name__", repr(kind)), "makes": made}


def action_record(action: argparse.Action) -> dict:
    return {"dest": action.dest, "action": type(action).__name__, "default": repr(action.default),
            "const": repr(action.const), "type": type_record(action.type),
            "choices": None if action.choices is None else [repr(c) for c in action.choices],
            "nargs": action.nargs, "required": action.required, "metavar": action.metavar}


def flags(parser: argparse.ArgumentParser, command: str = "pretrieve") -> dict:
    """{command: {"flags": {flag or positional: record}, "exclusive": [...]}} for `parser` and its subcommands."""
    found = {command: {"flags": {}, "exclusive": sorted(
        [sorted("/".join(a.option_strings) or a.dest for a in group._group_actions), group.required]
        for group in parser._mutually_exclusive_groups)}}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(flags(sub, f"{command} {name}"))
        name = "/".join(action.option_strings) or action.dest
        found[command]["flags"][name] = action_record(action)
    return found


def record_text(found: dict) -> str:
    """The record as JSON with one line per flag, so that a change reads as a one-line diff."""
    one = lambda value: json.dumps(value, sort_keys=True)  # noqa: E731
    commands = []
    for command in sorted(found):
        rows = ",\n".join(f"   {one(flag)}: {one(record)}" for flag, record in sorted(found[command]["flags"].items()))
        commands.append(f' {one(command)}: {{\n  "exclusive": {one(found[command]["exclusive"])},\n'
                        f'  "flags": {{\n{rows}\n  }}\n }}')
    return "{\n" + ",\n".join(commands) + "\n}\n"


def test_every_commands_flags_are_as_recorded():
    now, recorded = flags(root_parser()), json.loads(RECORD.read_text())
    changed = [f"{command}: {'added' if command not in recorded else 'removed'}"
               for command in sorted(set(now) ^ set(recorded))]
    for command in sorted(set(now) & set(recorded)):
        was, new = recorded[command]["flags"], now[command]["flags"]
        changed += [f"{command} {flag}: {'added' if flag in new else 'removed'}" for flag in sorted(set(was) ^ set(new))]
        changed += [f"{command} {flag}: {key} {was[flag][key]!r} -> {new[flag][key]!r}"
                    for flag in sorted(set(was) & set(new)) for key in sorted(set(was[flag]) | set(new[flag]))
                    if was[flag].get(key) != new[flag].get(key)]
        if recorded[command]["exclusive"] != now[command]["exclusive"]:
            changed.append(f"{command}: exclusive groups {recorded[command]['exclusive']} -> {now[command]['exclusive']}")
    assert not changed, ("the command line changed (if meant: python tests/test_cli_flags.py writes the record "
                         "again):\n" + "\n".join(changed))


def test_the_record_sees_a_changed_flag(monkeypatch):
    """A default, a type and a choice, changed on the built parser: each is a difference."""
    parser = root_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    prepare = commands.choices["prepare"]
    recorded = flags(parser)
    by_flag = {a.option_strings[0]: a for a in prepare._actions if a.option_strings}
    monkeypatch.setattr(by_flag["--max-len"], "default", 511)
    assert flags(parser) != recorded
    monkeypatch.undo()
    monkeypatch.setattr(by_flag["--part"], "type", int)  # at_least(0) refuses -1
    assert flags(parser) != recorded
    monkeypatch.undo()
    monkeypatch.setattr(by_flag["--on-error"], "choices", ("fail",))
    assert flags(parser) != recorded


if __name__ == "__main__":
    sys.path.insert(0, str(RECORD.parents[2]))
    RECORD.write_text(record_text(flags(root_parser())))
    print(f"wrote {RECORD}")
