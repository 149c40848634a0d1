"""mkdocs hooks (mkdocs.yml `hooks:`): repository files that the documentation links to become part of the site.

The pages in docs/ are written to read on GitHub too, so they link files outside docs/ by their relative path
(`../launchers/README.md`), which the site, built from docs/ alone, cannot serve. `on_files` adds every such
file to the site under `repository/<its path in the repository>` (a markdown file as a page, whose own links
are followed in turn; any other file as itself), and `on_page_markdown` points the links of the site's pages
at those copies. The sources keep their links, so GitHub and the site both reach the file; mkdocs then checks
each rewritten link and #anchor as it checks any other.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from urllib.parse import quote, unquote

from mkdocs.structure.files import File

REPOSITORY = "repository"  # the site folder that holds the repository's files
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"(!?\[[^\]]*\]\(\s*<?)([^)\s>]+)")  # (what precedes the target, the target)
_REFERENCE = re.compile(r"^(\s{0,3}\[[^\]]+\]:\s*<?)(\S+?)(?=>?(?:\s|$))")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)

_origins: dict[str, Path] = {}  # src_uri of each page of the site -> its file in the repository


def on_files(files, config):
    root, docs = _root(config), Path(config.docs_dir).resolve()
    _origins.clear()
    _origins.update({page.src_uri: docs / page.src_uri for page in files.documentation_pages()})
    queue = list(_origins.values())
    while queue:
        source = queue.pop()
        for target in _targets(source.read_text(encoding="utf-8")):
            resolved = _resolve(source, target, root)
            if resolved is None or docs in resolved.parents or not resolved.is_file():
                continue  # a page of the site already, or nothing mkdocs could serve (its check reports it)
            src_uri = f"{REPOSITORY}/{resolved.relative_to(root).as_posix()}"
            if files.get_file_from_path(src_uri) is None:
                files.append(File.generated(config, src_uri, abs_src_path=str(resolved)))
                if resolved.suffix == ".md":
                    _origins[src_uri] = resolved
                    queue.append(resolved)
    return files


def on_page_markdown(markdown, page, config, files):
    source = _origins.get(page.file.src_uri)
    if source is None:
        return markdown
    root, docs = _root(config), Path(config.docs_dir).resolve()

    def site_link(target: str) -> str:
        resolved = _resolve(source, target, root)
        if resolved is None:
            return target
        site = resolved.relative_to(docs) if docs in resolved.parents else REPOSITORY / resolved.relative_to(root)
        if files.get_file_from_path(site.as_posix()) is None:
            return target  # not in the site: left for mkdocs to report
        _, hash_sign, anchor = target.partition("#")
        relative = posixpath.relpath(site.as_posix(), posixpath.dirname(page.file.src_uri) or ".")
        return quote(relative) + hash_sign + anchor

    return _rewrite_links(markdown, site_link)


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _resolve(source: Path, target: str, root: Path) -> Path | None:
    """The repository file a relative link of `source` names, or None (a URL, an anchor, outside the repository)."""
    file = target.partition("#")[0]
    if not file or _SCHEME.match(target) or file.startswith("/"):
        return None
    resolved = (source.parent / unquote(file)).resolve()
    return resolved if root in resolved.parents else None


def _prose(markdown: str):
    """(line, is prose) for every line: lines in fenced code blocks are not prose."""
    fence = None
    for line in markdown.split("\n"):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            yield line, False
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            yield line, False
        else:
            yield line, True


def _targets(markdown: str) -> list[str]:
    found = []
    _rewrite_links(markdown, lambda target: found.append(target) or target)
    return found


def _rewrite_links(markdown: str, relink) -> str:
    """`markdown` with the target of every inline link and link reference definition outside code replaced by
    `relink(target)`."""
    def swap(match: re.Match) -> str:
        return match.group(1) + relink(match.group(2))

    lines = []
    for line, prose in _prose(markdown):
        if prose:
            line = _REFERENCE.sub(swap, line)
            pieces, pos = [], 0
            for span in _CODE_SPAN.finditer(line):  # `[inline code](x)` is no link
                pieces += [_LINK.sub(swap, line[pos:span.start()]), span.group()]
                pos = span.end()
            line = "".join([*pieces, _LINK.sub(swap, line[pos:])])
        lines.append(line)
    return "\n".join(lines)
