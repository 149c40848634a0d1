"""A docs page's walk-through whose code is a test file's own."""
import re
from pathlib import Path

from .paths import ROOT


def walk_through_blocks(page: str, heading: str, code_file: str) -> tuple[str, list[str]]:
    """(the section of docs/`page` under `heading`, its python blocks), each block asserted to be `code_file`'s
    code line for line (indentation aside): a walk-through whose code a test runs."""
    def lines(text: str) -> str:
        return "\n".join(line.strip() for line in text.strip().splitlines())

    section = (ROOT / "docs" / page).read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    for block in blocks:
        assert lines(block) in lines(Path(code_file).read_text()), block
    return section, blocks
