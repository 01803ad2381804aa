"""Structured output (engine/tr/grammar.py) and grammar-aware drafting (engine/constrained.py) on the
real tokenizer with tiny grammars: masks per path leave the committed state as it was, a complete
grammar ends the output, forced tokens become a chain, forbidden drafts are cut with their subtrees,
and bad specs are InvalidArgument with the grammar engine's message."""

from __future__ import annotations

import json

import pytest
import torch

from trserve.core.errors import InvalidArgument
from trserve.engine.constrained import constrained_draft
from trserve.engine.step import Draft
from trserve.engine.tr.grammar import GrammarCompiler, StructuredOutput
from trserve.engine.tr.tree import compile_parents, load_template
from trserve.engine.tuning.online import StepPlan


@pytest.fixture(scope="module")
def compiler(loaded_smollm2) -> GrammarCompiler:
    tok = loaded_smollm2.tokenizer
    return GrammarCompiler(tok, int(loaded_smollm2.model.config.vocab_size), frozenset({tok.eos_token_id}))


@pytest.fixture(scope="module")
def ids(loaded_smollm2):
    return lambda *pieces: [loaded_smollm2.tokenizer.convert_tokens_to_ids(p) for p in pieces]


def test_masks_follow_each_path_and_leave_the_committed_state(compiler, ids) -> None:
    g = compiler.compile(StructuredOutput("regex", "ab(c|d)")).matcher()
    a, b, c, d, x = ids("a", "b", "c", "d", "x")
    ok = g.allowed([[], [a], [a, b]])  # [3, V]
    assert ok[0, a] and not ok[0, b] and not ok[0, x]
    assert ok[1, b] and not ok[1, a]
    assert ok[2, c] and ok[2, d] and not ok[2, x]
    assert torch.equal(g.allowed([[]]), ok[:1])  # rolled back: the committed state is unchanged
    logits = torch.zeros(2, ok.shape[1] + 3)  # ids past the tokenizer's are never allowed
    g.mask(logits, [[a, b], []])
    assert logits[0, c] == 0 and logits[0, x] == float("-inf") and (logits[:, -3:] == float("-inf")).all()
    assert g.take([a, b]) == 2 and not g.done and g.committed == 2
    assert g.take([d, x]) == 1 and g.done  # complete after d: x is not kept


def test_forced_tokens_are_drafted_as_a_chain(compiler, loaded_smollm2) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    g = compiler.compile(StructuredOutput("json_schema", json.dumps(schema))).matcher()
    template = load_template("cpu-hybrid")
    draft = constrained_draft(None, g, 7, 8, lambda parent: compile_parents(template, parent))
    text = loaded_smollm2.tokenizer.decode(draft.tokens[1:].tolist())
    n = draft.tokens.shape[0]
    assert draft.tokens[0] == 7 and text == '{"name":' and n > 2 and draft.constrained  # forced: key and punctuation
    assert draft.tree.parent.tolist() == [0] + list(range(n - 1)) and draft.sources[1:] == (4,) * (n - 1)
    assert constrained_draft(None, g, 7, 2, lambda parent: compile_parents(template, parent)).tokens.shape[0] == 3


def test_drafts_the_grammar_forbids_are_cut_with_their_subtrees(compiler, ids) -> None:
    g = compiler.compile(StructuredOutput("regex", "(ab|ac)d")).matcher()
    a, b, c, d, x = ids("a", "b", "c", "d", "x")
    template = load_template("cpu-hybrid")
    # root 0: children a (1), x (2); a: b (3), x (4); x: a (5); b: d (6); c (7) under a
    parent = [0, 0, 0, 1, 1, 2, 3, 1]
    tokens = [99, a, x, b, x, a, d, c]
    tree = compile_parents(template, parent)
    draft = Draft(torch.tensor(tokens), tree, StepPlan(tree, None, explore=False), None, (0,) + (1,) * 7)
    assert g.forced() == []  # a first, then b or c: nothing forced at the root
    cut = constrained_draft(draft, g, 99, 8, lambda p: compile_parents(template, p))
    assert cut.tokens.tolist() == [99, a, b, c, d]  # by depth, then index
    assert cut.tree.parent.tolist()[1:] == [0, 1, 1, 2] and cut.constrained
    whole = compiler.compile(StructuredOutput("regex", ".*")).matcher()
    assert constrained_draft(draft, whole, 99, 8, lambda p: compile_parents(template, p)) is draft  # nothing cut


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput("regex", "(a"), "unclosed group"),
    (StructuredOutput("json_schema", '{"type": "objectx"}'), "objectx"),
    (StructuredOutput("grammar", "start: foo"), "foo"),
])
def test_bad_specs_say_why(compiler, spec, words) -> None:
    with pytest.raises(InvalidArgument, match=words):
        compiler.compile(spec)


def test_specs_are_checked_when_built() -> None:
    for kwargs in (dict(kind="xml"), dict(kind="choice"), dict(kind="choice", choices=("",)),
                   dict(kind="json_schema", spec="{nope"), dict(kind="json_schema", spec="[1]"), dict(kind="regex")):
        with pytest.raises(InvalidArgument):
            StructuredOutput(**kwargs)


def test_gbnf_grammars_are_taken_too(compiler, ids) -> None:
    g = compiler.compile(StructuredOutput("grammar", 'root ::= "a" ("b" | "c")')).matcher()
    a, b, c, x = ids("a", "b", "c", "x")
    ok = g.allowed([[a]])
    assert ok[0, b] and ok[0, c] and not ok[0, x]
