import json

import pytest
import torch

from trserve.core.errors import InvalidArgument, NotFound
from trserve.engine.tr.tree import TreeTemplate, builtin_trees, compile_tree, grow_tree, load_template


def test_compile_worked_example():
    t = compile_tree(TreeTemplate.from_paths("ex", [[0, 0], [1], [0]]))
    assert t.parent.tolist() == [0, 0, 0, 1]
    assert t.rank.tolist() == [0, 0, 1, 0]
    assert t.depth.tolist() == [0, 1, 1, 2]
    assert t.levels == ((1, 3), (3, 4))
    visible = (t.mask == 0).int().tolist()
    assert visible == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert t.mask[0, 1] == torch.finfo(torch.float32).min
    assert t.path_to(3) == [0, 1, 3]
    assert t.children == ((1, 2), (3,), (), ())


def test_paper_template_shape():
    t = load_template("paper")
    assert t.size == 80
    per_depth = [sum(1 for p in t.paths if len(p) == d) for d in range(1, 7)]
    assert per_depth == [8, 21, 25, 15, 8, 3]
    c = compile_tree(t)
    assert c.n == 81 and c.max_depth == 6
    # every node sees exactly depth+1 positions: itself and its ancestors
    assert ((c.mask == 0).sum(dim=1) == c.depth + 1).all()


def test_builtin_trees_all_compile():
    names = builtin_trees()
    assert {"paper", "cpu-8", "cpu-16"} <= set(names)
    for name in names:
        assert compile_tree(load_template(name)).n > 1


@pytest.mark.parametrize(
    "paths, message",
    [([], "no nodes"), ([[0, 1]], "no parent"), ([[0], [0]], "twice"), ([[-1]], "ranks in"), ([[0], []], "non-empty"),
     ([[True]], "booleans"), ([["a"]], "integer")],
)
def test_bad_templates_raise_actionable_errors(paths, message):
    with pytest.raises(InvalidArgument, match=message):
        TreeTemplate.from_paths("bad", paths)


def test_unknown_tree_name():
    with pytest.raises(NotFound, match="unknown tree 'nope'.*paper"):
        load_template("nope")


def test_template_files(tmp_path):
    good = tmp_path / "mine.json"
    good.write_text(json.dumps({"paths": [[0], [0, 0], [1]]}))
    assert load_template(str(good)).paths == ((0,), (1,), (0, 0))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        load_template(str(broken))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"nodes": [[0]]}))
    with pytest.raises(InvalidArgument, match='"paths"'):
        load_template(str(wrong))


def test_grow_tree_is_prefix_closed_and_ranked():
    scores = {(0,): 0.6, (1,): 0.1, (0, 0): 0.4, (0, 1): 0.05, (1, 0): 0.2}
    t = grow_tree("g", scores, 3)
    assert t.paths == ((0,), (1,), (0, 0))  # (1, 0) outscores (1,) but needs its parent first
    assert grow_tree("g", scores, 2).paths == ((0,), (0, 0))
    with pytest.raises(InvalidArgument):
        grow_tree("g", scores, 0)
