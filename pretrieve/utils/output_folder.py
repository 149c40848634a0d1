"""What a command may do to the folder (or file) it is told to write: never remove what is not its own.

Two kinds of output:
- written whole (`export`, `tokenizer train`, `eval`): an export or a tokenizer is made in a temporary folder
  beside OUT and renamed into place. OUT may be new or empty; an earlier output of the same kind is replaced
  only with `--overwrite`; anything else is refused, naming what is there, before any work.
- added to, or resumed (`encode`, `prepare`, `farm`, `report`, `scale run`): OUT may hold only what the command
  itself writes there; anything else is refused before any work, naming it.

A file output (`mine`, `teacher-scores`) that exists is replaced only with `--overwrite`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

SHOWN = 5  # entries named in a refusal


class OutputInUse(ValueError):
    """OUT holds something this command would lose or mix with its own output."""


def _listing(out: Path, entries: list[str]) -> str:
    shown = [f"{e}/" if (out / e).is_dir() else e for e in sorted(entries)[:SHOWN]]
    more = f" and {len(entries) - SHOWN} more" if len(entries) > SHOWN else ""
    return ", ".join(shown) + more


def check_whole_output(out: str | Path, what: str, is_earlier: Callable[[Path], bool], overwrite: bool,
                       kept: Callable[[str], bool] = lambda name: False) -> None:
    """OUT, to be replaced whole by a new `what` (an export, a tokenizer): new, empty, or an earlier `what`
    (`is_earlier(out)`) with `overwrite`; otherwise refused, naming what is there. Entries that `kept(name)`
    claims are left as they are and not counted. Nothing is written here."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise OutputInUse(f"{out}: exists and is not a folder; give a new or empty folder for the {what}")
    entries = [p.name for p in out.iterdir() if not kept(p.name)]
    if not entries:
        return
    if is_earlier(out):
        if overwrite:
            return
        raise OutputInUse(f"{out}: holds an earlier {what}; pass --overwrite to replace it, or give another folder")
    raise OutputInUse(f"{out}: holds {len(entries)} entries that are not a {what} ({_listing(out, entries)}); "
                      f"nothing was written. Give a new or empty folder (--overwrite replaces only an earlier "
                      f"{what})")


def check_own_entries(out: str | Path, what: str, is_own: Callable[[str], bool],
                      earlier: Callable[[Path], bool] | None = None) -> None:
    """OUT, which a command adds to or resumes in: refused if it holds any entry that `is_own(name)` does not
    claim (nothing there would be removed, but the command's output would mix with it). A folder that
    `earlier(out)` recognises as this command's (by the record it writes first) is taken as it is: the command
    removes nothing it did not write, so what a user added there since is safe."""
    out = Path(out)
    if not out.exists() or (earlier is not None and out.is_dir() and earlier(out)):
        return
    if not out.is_dir():
        raise OutputInUse(f"{out}: exists and is not a folder; give a new folder for the {what}")
    foreign = [p.name for p in out.iterdir() if not is_own(p.name)]
    if foreign:
        raise OutputInUse(f"{out}: holds {len(foreign)} entries that the {what} does not write "
                          f"({_listing(out, foreign)}); nothing was written. Give a new or empty folder, or one "
                          f"holding an earlier {what} only")


def check_file_output(out: str | Path, what: str, overwrite: bool) -> None:
    """OUT, a file written whole: new, or an existing file replaced with `overwrite`; never a folder."""
    out = Path(out)
    if out.is_dir():
        raise OutputInUse(f"{out}: is a folder; --out names the {what} file to write")
    if out.exists() and not overwrite:
        raise OutputInUse(f"{out}: exists; pass --overwrite to replace it, or give another file")


def staging_folder(out: Path) -> Path:
    """The temporary folder beside OUT that a whole output is written to; none left from an earlier attempt."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def replace_directory(tmp: Path, out: Path) -> Path:
    """Move the finished folder `tmp` to `out`, replacing what was there: a reader sees the old output or the
    new one. The old one is set aside as `.OUT.old` during the swap; if a stop came between the two renames,
    the next call puts it back first, so an output is never lost half-replaced."""
    old = out.with_name(f".{out.name}.old")
    if old.is_dir() and not out.exists():  # an earlier swap stopped between its renames
        old.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    return out
