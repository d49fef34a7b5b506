"""Selector matching: which modules a selector names (rules in spec.md "Selectors")."""

from __future__ import annotations

import difflib
import functools
import re
from fnmatch import fnmatchcase

from .ir import Selector
from .tree import ModuleInfo, ModuleTree, class_tokens, is_below, name_tokens


@functools.lru_cache(maxsize=1024)
def _path_regex(pattern: str) -> re.Pattern:
    """``a.*.b`` → one segment per ``*``; ``**`` → any number of segments (zero included)."""
    parts = []
    for segment in pattern.split("."):
        if segment == "**":
            parts.append(None)
            continue
        out = []
        i = 0
        while i < len(segment):
            c = segment[i]
            if c == "*":
                out.append("[^.]*")
            elif c == "?":
                out.append("[^.]")
            elif c == "[":
                close = segment.find("]", i + 1)
                if close == -1:
                    out.append(re.escape(c))
                else:
                    body = segment[i + 1 : close]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append(f"[{body}]")
                    i = close
            else:
                out.append(re.escape(c))
            i += 1
        parts.append("".join(out))
    # Each segment is matched together with the dot that follows it, against
    # ``path + "."``, so ``**`` is simply "any number of whole segments".
    regex = "".join(r"(?:[^.]+\.)*" if part is None else part + r"\." for part in parts)
    return re.compile(regex + r"\Z")


def _path_matches(pattern: str, path: str) -> bool:
    return bool(path) and bool(_path_regex(pattern).match(path + "."))


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def matches(selector: Selector, info: ModuleInfo) -> bool:
    """Whether ``selector`` names the module ``info`` itself (not its subtree)."""
    kind = selector.kind
    if kind == "class":
        return any(fnmatchcase(name, selector.pattern) for name in info.class_names)
    if kind == "path":
        return _path_matches(selector.pattern, info.path)
    if kind == "regex":
        return bool(_compiled(selector.pattern).search(info.path))
    if kind == "name":
        return bool(info.path) and fnmatchcase(info.name, selector.pattern)
    if kind == "word":
        return _word_matches(selector.pattern, info)
    raise ValueError(f"unknown selector kind {kind!r}")  # pragma: no cover


def _contains(haystack: tuple[str, ...], needle: tuple[str, ...]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def _word_matches(word: str, info: ModuleInfo) -> bool:
    if not info.path:
        return False
    needle = name_tokens(word)
    if info.name == word or _contains(name_tokens(info.name), needle):
        return True
    return _contains(class_tokens(info.cls.__name__), needle)


def select(selector: Selector, tree: ModuleTree, within: list[str] | None = None) -> list[str]:
    """Paths of the modules ``selector`` names, in tree order (optionally only below ``within``)."""
    found = []
    for info in tree:
        if within is not None and not any(is_below(info.path, root) for root in within):
            continue
        if matches(selector, info):
            found.append(info.path)
    return found


def topmost(paths: list[str]) -> list[str]:
    """Drop paths that lie below another path of the list."""
    result: list[str] = []
    for path in sorted(paths, key=lambda p: (p.count(".") if p else -1, p)):
        if not any(is_below(path, kept) for kept in result):
            result.append(path)
    order = {p: i for i, p in enumerate(paths)}
    return sorted(result, key=order.__getitem__)


def suggestions(selector: Selector, tree: ModuleTree, limit: int = 3) -> list[str]:
    """The names in the tree closest to a selector that matched nothing."""
    if selector.kind == "class":
        vocabulary = {n for info in tree for n in info.class_names}
    elif selector.kind == "path":
        vocabulary = {info.path for info in tree if info.path}
        depth = selector.pattern.count(".")
        vocabulary |= {".".join(p.split(".")[: depth + 1]) for p in vocabulary}
    else:
        vocabulary = {info.name for info in tree if info.path}
        vocabulary |= {n for info in tree for n in info.class_names}
    probe = selector.pattern.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(probe, sorted(vocabulary), n=limit, cutoff=0.5)
    if not close and selector.kind in ("word", "name"):
        lowered = probe.lower()
        close = sorted(v for v in vocabulary if lowered and lowered in v.lower())[:limit]
    return close
