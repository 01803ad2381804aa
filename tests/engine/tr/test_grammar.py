"""Structured output (engine/tr/grammar.py) and grammar-aware drafting (engine/drafting/constrained.py) on the
real tokenizer with tiny grammars: masks per path leave the committed state as it was, a complete
grammar ends the output, forced tokens become a chain, forbidden drafts are cut with their subtrees,
and bad specs are InvalidArgument with the grammar engine's message."""

from __future__ import annotations

import json

import pytest
import torch

from trserve.core.errors import InvalidArgument, OutputStuck
from trserve.engine.drafting.constrained import constrained_draft
from trserve.engine.drafting.step import Draft
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


# a schema the validation walk passes (it stays in the free string) whose second key opens a level of
# 1000 optional properties: past the parser's 2000 items a row once the model closes the string
LATE_LIMIT = {"type": "object", "required": ["name", "a"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "a": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                        for i in range(1000)}}}}


@pytest.mark.parametrize("spec, words", [  # issue 56, defects 1-3: each refused at validation, naming why
    (StructuredOutput("choice", choices=tuple(f"opt{i}" for i in range(2001))), "max is 2000"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(1000)}})), "limit of the grammar engine.*max is 2000"),
    (StructuredOutput("regex", "(a{1000}){1000}"), "limit of the grammar engine.*too many expressions"),
    (StructuredOutput("grammar", 'start: "a" start'), "limit of the grammar engine"),
    (StructuredOutput("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})),
     "can match no output"),
    (StructuredOutput("regex", "[^\\s\\S]"), "can match no output"),
    (StructuredOutput("grammar", "start: start"), "can match no output"),
    (StructuredOutput("grammar", "root ::= (((("), "cannot be read: GbnfToLarkError: Expected '\\)'"),
    (StructuredOutput("grammar", "root ::= ["), "cannot be read: GbnfToLarkError: Unexpected end"),
    (StructuredOutput("grammar", "root ::= x{5,2}"), "cannot be read: .*Rule 'x' not found"),
    (StructuredOutput("grammar", "root ::= " + "(" * 3000 + '"a"' + ")" * 3000), "nests too deeply"),
])
def test_grammars_that_cannot_be_served_are_refused_naming_why(compiler, spec, words) -> None:
    with pytest.raises(InvalidArgument, match=words):
        compiler.compile(spec)


@pytest.mark.parametrize("spec", [
    StructuredOutput("regex", "a{0}"),  # the empty output is a match: served (it stops at once)
    StructuredOutput("choice", choices=tuple(f"opt{i}" for i in range(1500))),
    StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(400)}})),
    StructuredOutput("json_schema", json.dumps({"$defs": {"A": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}})),
])
def test_grammars_within_the_limits_are_taken(compiler, spec) -> None:
    compiler.compile(spec)


def test_a_limit_met_while_decoding_ends_with_output_stuck(compiler, loaded_smollm2) -> None:
    """Past the validation walk, the grammar engine's limit is OutputStuck (the request ends alone),
    never an assertion or a mask of the stop alone."""
    g = compiler.compile(StructuredOutput("json_schema", json.dumps(LATE_LIMIT))).matcher()
    tokens = loaded_smollm2.tokenizer.encode('{"name": "Bob", "a": {"p1": 1}}')
    with pytest.raises(OutputStuck, match="max is 2000"):
        for t in tokens:
            g.allowed([[]])
            g.take([t])
    assert 3 < g.committed < len(tokens) - 3  # past the walk, before the object closed


def test_no_allowed_token_is_output_stuck(compiler, ids) -> None:
    """A grammar that allows only the stop where min_tokens forbids it: the row has no allowed token."""
    from trserve.engine.tr.rules import LogitRules
    from trserve.engine.tr.sampling import choose

    g = compiler.compile(StructuredOutput("regex", "ab")).matcher()
    g.take(ids("a", "b"))
    eos = compiler._eos[0]
    rules = LogitRules(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.tensor([eos]), 5, grammar=g)
    logits = torch.randn(1, compiler.vocab_size)
    with pytest.raises(OutputStuck, match="no token is allowed at output token 2.*min_tokens=5"):
        choose(logits, None, 2, rules=rules, contexts=[[]])
    assert int(choose(logits, None, 5, rules=rules, contexts=[[]])[0]) == eos  # past min_tokens: the stop
