"""The planning snapshot (``transformdsl.tree.ModuleTree``) and selection on it, against a naive model.

The tree keeps indexes (children, groups, depths, positions) so that planning a model of
thousands of modules takes milliseconds (``benchmarks/bench_plan.py``).  These tests check it
against the obvious O(n)-per-query definitions, on a real model, after random structural edits
like the ones transforms make while planning (remove a subtree, add a module after its parent,
re-type a module).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from transformdsl.models import BUILTIN
from transformdsl.parser import make_selector
from transformdsl.selectors import matches, select, topmost
from transformdsl.tree import ModuleTree, below_any, is_below, parameter_bytes


@functools.cache
def flux():
    return BUILTIN["flux"]()


class Naive:
    """The snapshot as an ordered dict scanned on every query (the definition)."""

    def __init__(self, tree: ModuleTree):
        self.infos = {info.path: info.cls for info in tree}

    def subtree(self, path):
        return [p for p in self.infos if path == "" or p == path or p.startswith(path + ".")]

    def children(self, path):
        depth = 0 if path == "" else path.count(".") + 1
        return [p for p in self.subtree(path) if p and p.count(".") == depth and p != path]

    def remove(self, path):
        for p in self.subtree(path):
            del self.infos[p]

    def add(self, path, cls, after):
        if after is None or after not in self.infos:
            self.infos[path] = cls
            return
        items = list(self.infos.items())
        items.insert([p for p, _ in items].index(after) + len(self.subtree(after)), (path, cls))
        self.infos = dict(items)


SELECTORS = ["Linear", "*Attention", "norm", "attn", "to_?", "*norm*", "transformer_blocks.*",
             "**.attn.**", "single_transformer_blocks.[01].attn", "re:^proj_out$", "re:norm", "fused", "Fused*"]


class Fused(nn.Linear):
    pass


edits = st.lists(st.tuples(st.sampled_from(["remove", "add", "add_top", "replace"]), st.integers(0, 10_000)),
                 max_size=12)


@settings(max_examples=60, deadline=None)
@given(edits)
def test_tree_after_edits_agrees_with_the_naive_definition(ops):
    tree, naive = ModuleTree.of(flux()), None
    naive = Naive(tree)
    counter = 0
    for op, pick in ops:
        paths = [p for p in naive.infos if p]
        if not paths:
            break
        path = paths[pick % len(paths)]
        if op == "remove":
            tree.remove(path)
            naive.remove(path)
        elif op == "add":  # as fuse qkv does: a new child placed after its parent's subtree
            counter += 1
            new = f"{path}.fused{counter}"
            tree.add(new, Fused, after=path)
            naive.add(new, Fused, after=path)
        elif op == "add_top":
            counter += 1
            tree.add(f"fused{counter}", Fused)
            naive.add(f"fused{counter}", Fused, None)
        else:
            tree.replace(path, Fused)
            naive.infos[path] = Fused
        _ = [select(make_selector(s), tree) for s in ("norm", "Linear")]  # warm the indexes between edits

    assert [i.path for i in tree] == list(naive.infos)
    assert [i.cls for i in tree] == list(naive.infos.values())
    assert len(tree) == len(naive.infos)
    probes = ["", "transformer_blocks", "transformer_blocks.0", "transformer_blocks.0.attn", "norm_out",
              "single_transformer_blocks.1", "nowhere"]
    for path in probes:
        assert [i.path for i in tree.subtree(path)] == naive.subtree(path), path
        assert [i.path for i in tree.children(path)] == naive.children(path), path
    for text in SELECTORS:
        selector = make_selector(text)
        expected = [p for p, cls in naive.infos.items() if matches(selector, tree[p])]
        assert select(selector, tree) == expected, text
        for within in (["transformer_blocks.0", "single_transformer_blocks"], ["norm_out", "proj_out", "nowhere"]):
            inside = [p for p in expected if any(is_below(p, r) for r in within)]
            assert select(selector, tree, within) == inside, (text, within)


def test_snapshot_counts_modules_and_distinct_bytes():
    gpt2 = BUILTIN["gpt2"]()  # tied lm_head/wte: counted once
    tree = ModuleTree.of(gpt2)
    assert tree.module_count == sum(1 for _ in gpt2.modules()) == len(tree)
    assert tree.total_bytes == parameter_bytes(gpt2)


@pytest.mark.parametrize("paths, expected", [
    (["a.b", "a", "c.d", "a.b.c", "c"], ["a", "c"]),
    (["a.b.c", "a.b", "x"], ["a.b", "x"]),
    (["ab", "a", "a.b"], ["ab", "a"]),
    (["a", "", "b"], [""]),
    (["b", "a", "b"], ["a", "b"]),  # a path given twice takes its last place
    ([], []),
])
def test_topmost(paths, expected):
    assert topmost(paths) == expected


@pytest.mark.parametrize("path, roots, expected", [
    ("a.b.c", {"a"}, True),
    ("a.b.c", {"a.b.c"}, True),
    ("a.bc", {"a.b"}, False),
    ("ab.c", {"a"}, False),
    ("x", {""}, True),
    ("x", set(), False),
])
def test_below_any(path, roots, expected):
    assert below_any(path, frozenset(roots)) is expected
    assert any(is_below(path, r) for r in roots) is expected
