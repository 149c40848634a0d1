"""The documentation: README.md, docs/, launchers/README.md and the method studies' READMEs (studies/*/).

- Every relative link points at a file of the repository, and a `#anchor` at a heading of the page it names
  (GitHub's heading ids, which mkdocs.yml gives the site too).
- Every code block marked runnable runs and exits 0. The mark is an HTML comment on the line before the fence,
  invisible on GitHub and in the site: `<!-- runnable -->` (run by `make test`) or
  `<!-- runnable: integration -->` (slow, run by `make test-integration`, after the page's other runnable
  blocks). A page's blocks run in order, as a reader would type them, in a fresh folder holding links to the
  repository's sources, so `configs/...` and `pretrieve/assets/...` resolve and outputs stay out of the
  repository: ```bash blocks with `bash -e -o pipefail`, ```python blocks with this interpreter, whose bin
  folder (the venv's `pretrieve`) comes first on PATH.
- `mkdocs build --strict` succeeds (skipped where mkdocs is not installed), and every relative link of the
  built site reaches a file of the site: a link to a repository file outside docs/ must reach the copy the site
  serves (tools/mkdocs_hooks.py), not a path that exists on GitHub only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from support import pretrain_env

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "launchers" / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "studies").glob("*/README.md"))]
# what runnable blocks may read, linked into their folder; everything they write lands beside these links
SOURCES = ("pretrieve", "configs", "ds_configs", "launchers", "benchmarks", "studies", "docs", "tools", "tests",
           "setup.py", "Makefile", "README.md", "mkdocs.yml")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*runnable(?::\s*([\w-]+))?\s*-->$")
KINDS = {None: "fast", "integration": "integration"}
LANGUAGES = ("bash", "sh", "python")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
FAST_TIMEOUT_S, INTEGRATION_TIMEOUT_S = 180, 900


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    kind: str | None  # None: not runnable; "fast" or "integration"


@dataclass
class Page:
    prose: list[tuple[int, str]]  # (line number, text) outside code blocks
    blocks: list[Block]
    problems: list[str]  # malformed marks


def parse(path: Path) -> Page:
    lines = path.read_text(encoding="utf-8").splitlines()
    prose, blocks, problems = [], [], []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        mark = MARKER.match(lines[i - 1].strip()) if i else None
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        kind = None
        if mark:
            kind = KINDS.get(mark.group(1))
            if kind is None:
                problems.append(f"{rel(path)}:{i}: unknown runnable kind {mark.group(1)!r} (one of: integration)")
            elif fence.group(2) not in LANGUAGES:
                problems.append(f"{rel(path)}:{i + 1}: a runnable block must be one of {LANGUAGES}, "
                                f"not {fence.group(2) or 'unmarked'}")
                kind = None
        blocks.append(Block(path, i + 1, fence.group(2), "\n".join(lines[i + 1:end]) + "\n", kind))
        i = end + 1
    for number, text in prose:  # a mark whose next line is no fence marks nothing: say so
        if MARKER.match(text.strip()) and (number >= len(lines) or not FENCE.match(lines[number])):
            problems.append(f"{rel(path)}:{number}: runnable mark without a code block on the next line")
    return Page(prose, blocks, problems)


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def github_slug(heading: str) -> str:
    """GitHub's id of a heading: its text (links reduced to their text, tags dropped), lower case, characters
    other than letters, digits, `_`, `-` and spaces removed, spaces made `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    ids: set[str] = set()
    repeats: dict[str, int] = {}
    for _, text in parse(path).prose:
        heading = HEADING.match(text)
        if heading:
            slug = github_slug(heading.group(2))
            repeats[slug] = repeats.get(slug, -1) + 1
            ids.add(f"{slug}-{repeats[slug]}" if repeats[slug] else slug)  # a repeated heading gets -1, -2, ...
    return ids


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of `path` whose file, or whose #anchor in a markdown file, does not exist."""
    problems = []
    for number, text in parse(path).prose:
        text = re.sub(r"(`+).*?\1", "", text)  # inline code is no link
        targets = LINK.findall(text) + REFERENCE.findall(text)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...: not relative
                continue
            file, _, anchor = target.partition("#")
            where = f"{rel(path)}:{number}: {target}"
            resolved = (path.parent / unquote(file)).resolve() if file else path
            if root != resolved and root not in resolved.parents:
                problems.append(f"{where}: outside the repository")
            elif not resolved.exists():
                problems.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
                problems.append(f"{where}: no heading with that anchor in {rel(resolved)}")
    return problems


class _Hrefs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [value for name, value in attrs if name == "href" and value]


def site_link_problems(site: Path) -> list[str]:
    """Every relative link of the built site's pages that reaches no file of the site (a folder: its index.html)."""
    problems = []
    for page in sorted(site.rglob("*.html")):
        parser = _Hrefs()
        parser.feed(page.read_text(encoding="utf-8"))
        for href in parser.hrefs:
            url = urlsplit(href)
            if url.scheme or url.netloc or not url.path or url.path.startswith("/"):
                continue  # another site, an anchor of this page, or absolute (the 404 page's, by design)
            target = (page.parent / unquote(url.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if site.resolve() not in target.parents or not target.is_file():
                problems.append(f"{page.relative_to(site)}: {href}: no such file in the site")
    return problems


def runnable(kind: str) -> list[Path]:
    return [page for page in PAGES if any(block.kind == kind for block in parse(page).blocks)]


def run_blocks(page: Path, kinds: tuple[str, ...], folder: Path, timeout: int) -> None:
    work, scripts = folder / "work", folder / "blocks"
    work.mkdir()
    scripts.mkdir()
    for name in SOURCES:
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    bin_dir = Path(sys.executable).parent
    env = pretrain_env(MPLBACKEND="Agg", NO_MKDOCS_2_WARNING="1")
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    for block in (b for b in parse(page).blocks if b.kind in kinds):
        script = scripts / f"line{block.line}.{'py' if block.language == 'python' else 'sh'}"
        script.write_text(block.code)
        command = [sys.executable, str(script)] if block.language == "python" else \
            ["bash", "-e", "-o", "pipefail", str(script)]
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, (f"{rel(page)}:{block.line}: the runnable block exited {done.returncode}\n"
                                      f"{block.code}\n--- output (tail) ---\n{(done.stdout + done.stderr)[-4000:]}")


def test_pages_exist_and_marks_are_well_formed():
    assert all(page.exists() for page in PAGES) and len(PAGES) > 3
    problems = [problem for page in PAGES for problem in parse(page).problems]
    assert not problems, "\n".join(problems)


def test_relative_links_and_anchors_resolve():
    problems = [problem for page in PAGES for problem in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_checks_find_broken_links_anchors_and_marks(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Fine-tuning: `pretrieve finetune`, `mine`\n\n## A\n## A\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md) [ok](other.md#fine-tuning-pretrieve-finetune-mine) [ok](#page)\n"
                    "[ok](other.md#a-1) `[not a link](missing.md)` [web](https://example.org/x.md)\n"
                    "[gone](missing.md)\n[bad anchor](other.md#no-such-heading)\n[ref]: missing-too.md\n\n"
                    "<!-- runnable -->\n```text\nx\n```\n\n<!-- runnable -->\n\nprose\n")
    problems = link_problems(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert problems[0].endswith(":5: missing.md: no such file")
    assert ":6: other.md#no-such-heading: no heading with that anchor in " in problems[1]
    assert problems[2].endswith(":7: missing-too.md: no such file")
    marks = parse(page).problems
    assert len(marks) == 2 and "must be one of" in marks[0] and "without a code block" in marks[1]


def test_readme_names_every_test_target():
    """CI and newcomers take the test commands from the README: every `test*` and `docs` target is there."""
    targets = re.findall(r"^(test[\w-]*|docs):", (ROOT / "Makefile").read_text(), re.M)
    readme = (ROOT / "README.md").read_text()
    assert {"test", "docs"} <= set(targets)
    assert [t for t in targets if f"make {t}`" not in readme] == []


def test_the_readme_example_leaves_git_status_clean():
    """Run in a checkout, the end-to-end example's outputs (each named in it) are all ignored by git."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    example = (ROOT / "README.md").read_text().split("## End-to-end example")[1].split("\n## ")[0]
    outputs = ["shards/wikipedia/manifest.json", "runs/tiny-dupmae/config.yaml", "exported/tiny-dupmae/config.json",
               "evals/tiny-dupmae/metrics.json", "farm.yaml", "farm/bm25/scifact-sample/zero-shot/run.trec",
               "report/report.html"]
    for output in outputs:
        assert output.split("/")[0] in example, output
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *outputs], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert [o for o in outputs if o not in ignored] == []


@pytest.mark.parametrize("page", runnable("fast"), ids=rel)
def test_runnable_blocks(page, tmp_path):
    run_blocks(page, ("fast",), tmp_path, FAST_TIMEOUT_S)


@pytest.mark.integration
@pytest.mark.parametrize("page", runnable("integration"), ids=rel)
def test_runnable_integration_blocks(page, tmp_path):
    run_blocks(page, ("fast", "integration"), tmp_path, INTEGRATION_TIMEOUT_S)


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the dev extra has it: make install)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (the dev extra has it: make install)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=pretrain_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()
    problems = site_link_problems(tmp_path / "site")
    assert not problems, "\n".join(problems)
    # the pages' links to files outside docs/ reach the site's copies of them
    launching = (tmp_path / "site" / "launching" / "index.html").read_text(encoding="utf-8")
    assert 'href="../repository/launchers/"' in launching and 'href="../repository/ds_configs/"' in launching


def test_the_site_hooks_relink_prose_not_code():
    """tools/mkdocs_hooks.py rewrites link targets in prose (inline links, reference definitions), never in code."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = ("See [a](../a.md#x) and `[b](../b.md)`, ![c](c.png).\n[ref]: <../d.md>\n"
            "```\n[e](../e.md)\n```\n~~~~text\n```\n[f](../f.md)\n~~~~\n[g](g.md \"title\")\n")
    assert hooks._targets(page) == ["../a.md#x", "c.png", "../d.md", "g.md"]
    assert hooks._rewrite_links(page, str.upper) == page.replace("../a.md#x", "../A.MD#X").replace(
        "(c.png", "(C.PNG").replace("<../d.md>", "<../D.MD>").replace("(g.md", "(G.MD")


def test_the_site_check_finds_links_the_site_cannot_serve(tmp_path):
    site = tmp_path / "site"
    (site / "page").mkdir(parents=True)
    (site / "other.html").write_text("<p>other</p>")
    (site / "page" / "index.html").write_text(
        '<a href="../other.html#x">ok</a> <a href="../">ok: the folder of index.html</a> <a href="#top">ok</a> '
        '<a href="https://example.org/a.md">ok</a> <a href="../../launchers/README.md">dead</a> '
        '<a href="../missing/">dead</a>')
    (site / "index.html").write_text('<a href="page/">ok</a>')
    assert site_link_problems(site) == ["page/index.html: ../../launchers/README.md: no such file in the site",
                                        "page/index.html: ../missing/: no such file in the site"]


def test_make_help_names_every_target():
    phony = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith(".PHONY:"))
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, check=True)
    listed = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("make ")}
    assert listed == set(phony.split()[1:]) - {"help"}, done.stdout
