"""Selector matching: which modules a selector names (rules in spec.md "Selectors")."""

from __future__ import annotations

import difflib
import functools
import re
from fnmatch import fnmatchcase

from .ir import Selector
from .regexes import compile_regex, search
from .tree import ModuleInfo, ModuleTree, below_any, class_names, class_tokens, name_tokens

# Path globs are matched by a wildcard matcher, not a regular expression: as a regex, ``**`` repeated
# (``**.**.**...x``) or ``*`` repeated in a segment backtracks combinatorially (40 ``**`` did not finish
# on the built-in UNet's paths in 120 s; 255 statements of ten each took 13.6 s).  Both levels, segments
# of a path and characters of a segment, use the two-pointer wildcard match, which backtracks only to
# the last star: O(pattern x text) steps at worst.


#: A pattern token: a literal character, ``?`` (one character), a compiled class, or ``*`` (any run).
_STAR = object()
_ANY = object()


@functools.lru_cache(maxsize=4096)
def _segment_tokens(segment: str) -> tuple:
    """``to_?[0-3]*`` -> its tokens (``[`` without a closing ``]`` is a literal; ``[!...]`` negates)."""
    tokens: list = []
    i = 0
    while i < len(segment):
        c = segment[i]
        if c == "*":
            if not tokens or tokens[-1] is not _STAR:  # `**` inside a segment is one star
                tokens.append(_STAR)
        elif c == "?":
            tokens.append(_ANY)
        elif c == "[" and segment.find("]", i + 1) != -1:
            close = segment.find("]", i + 1)
            body = segment[i + 1 : close]
            if body.startswith("!"):
                body = "^" + body[1:]
            tokens.append(re.compile(f"[{body}]"))
            i = close
        else:
            tokens.append(c)
        i += 1
    return tuple(tokens)


def _wildcard(tokens: tuple, items, one) -> bool:
    """Whether ``tokens`` (with :data:`_STAR` for any run of items) match all of ``items``; ``one(token,
    item)`` tests a single token.  Greedy, backtracking only to the last star: O(len(tokens) x len(items))."""
    t = i = 0
    star_t = star_i = -1
    n_tokens, n_items = len(tokens), len(items)
    while i < n_items:
        if t < n_tokens and tokens[t] is not _STAR and one(tokens[t], items[i]):
            t += 1
            i += 1
        elif t < n_tokens and tokens[t] is _STAR:
            star_t, star_i = t, i
            t += 1
        elif star_t >= 0:
            star_i += 1
            t, i = star_t + 1, star_i
        else:
            return False
    while t < n_tokens and tokens[t] is _STAR:
        t += 1
    return t == n_tokens


def _char(token, char: str) -> bool:
    if token is _ANY:
        return True
    if isinstance(token, str):
        return token == char
    return token.fullmatch(char) is not None


@functools.lru_cache(maxsize=65536)
def _segment_matches(segment: str, name: str) -> bool:
    return _wildcard(_segment_tokens(segment), name, _char)


@functools.lru_cache(maxsize=1024)
def _path_tokens(pattern: str) -> tuple:
    """A path glob's segments, ``**`` as :data:`_STAR` (several in a row are one: ``**.**`` = ``**``)."""
    tokens: list = []
    for segment in pattern.split("."):
        if segment == "**":
            if not tokens or tokens[-1] is not _STAR:
                tokens.append(_STAR)
        else:
            tokens.append(segment)
    return tuple(tokens)


@functools.lru_cache(maxsize=65536)
def _path_matches(pattern: str, path: str) -> bool:
    """``a.*.b`` -> one segment per ``*``; ``**`` -> any number of segments (zero included); the root
    (``""``) is never matched.  Cached: scripts repeat their globs, models their paths."""
    return bool(path) and _wildcard(_path_tokens(pattern), path.split("."), _segment_matches)


def matches(selector: Selector, info: ModuleInfo) -> bool:
    """Whether ``selector`` names the module ``info`` itself (not its subtree)."""
    kind = selector.kind
    if kind == "class":
        return _class_matches(selector.pattern, info.cls)
    if kind == "path":
        return _path_matches(selector.pattern, info.path)
    if kind == "regex":
        return search(compile_regex(selector.pattern), info.path)
    if kind == "name":
        return bool(info.path) and _name_matches(selector.pattern, info.name)
    if kind == "word":
        return bool(info.path) and _word_matches(selector.pattern, info.name, info.cls.__name__)
    raise ValueError(f"unknown selector kind {kind!r}")  # pragma: no cover


# Class, name and word matching depend on (pattern, class or last segment) only, and models
# repeat the same few names and classes in every block: the answers are cached.


@functools.lru_cache(maxsize=65536)
def _class_matches(pattern: str, cls: type) -> bool:
    return any(fnmatchcase(name, pattern) for name in class_names(cls))


@functools.lru_cache(maxsize=65536)
def _name_matches(pattern: str, name: str) -> bool:
    return fnmatchcase(name, pattern)


def _contains(haystack: tuple[str, ...], needle: tuple[str, ...]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


@functools.lru_cache(maxsize=65536)
def _word_matches(word: str, name: str, class_name: str) -> bool:
    needle = name_tokens(word)
    if name == word or _contains(name_tokens(name), needle):
        return True
    return _contains(class_tokens(class_name), needle)


def select(selector: Selector, tree: ModuleTree, within: list[str] | None = None) -> list[str]:
    """Paths of the modules ``selector`` names, in tree order (optionally only below ``within``)."""
    kind = selector.kind
    if kind in _BY_GROUP:
        # Decided once per (name, class) group, then put back in tree order.
        key_test = _BY_GROUP[kind]
        hits = [infos for (name, cls), infos in tree.groups().items() if key_test(selector.pattern, name, cls)]
        found = [info.path for infos in hits for info in infos]
        if within is not None:
            roots = frozenset(within)
            found = [path for path in found if below_any(path, roots)]
        if len(hits) > 1:
            found.sort(key=tree.position)
        return found
    if kind == "path" and "**" not in selector.pattern.split(".") and within is None:
        # Without `**` a path glob has a fixed number of segments.
        infos = tree.depths().get(selector.pattern.count(".") + 1, [])
    else:
        infos = tree if within is None else tree.within(within)
    test = _matcher(selector)
    return [info.path for info in infos if test(info)]


#: (pattern, last segment, class) -> whether a selector of that kind names the module.
_BY_GROUP = {
    "class": lambda pattern, name, cls: _class_matches(pattern, cls),
    "name": lambda pattern, name, cls: bool(name) and _name_matches(pattern, name),
    "word": lambda pattern, name, cls: bool(name) and _word_matches(pattern, name, cls.__name__),
}


def _matcher(selector: Selector):
    """``matches(selector, info)`` as a function of ``info`` alone (the pattern is compiled once)."""
    if selector.kind == "path":
        pattern = selector.pattern
        return lambda info: _path_matches(pattern, info.path)
    if selector.kind == "regex":
        compiled = compile_regex(selector.pattern)
        return lambda info: search(compiled, info.path)
    return lambda info: matches(selector, info)


def topmost(paths: list[str]) -> list[str]:
    """Drop paths that lie below another path of the list."""
    given = set(paths)
    if "" in given:
        return [""]
    order = {p: i for i, p in enumerate(paths)}  # a path given twice sorts at its last place
    kept = [p for p in given if not below_any(_parent_of(p), given)]
    return sorted(kept, key=order.__getitem__)


def _parent_of(path: str) -> str:
    """``a.b.c`` -> ``a.b``; a top-level path -> a name no path has (nothing is above it)."""
    head, dot, _ = path.rpartition(".")
    return head if dot else "\x00"


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
