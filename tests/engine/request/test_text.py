"""TextStream on the bundled tokenizer: its incremental deltas are what decoding every id at each
step gives, through multi-byte characters split across tokens, special tokens and stop-string cuts."""

import random

from trserve.engine.request.stops import StopChecker
from trserve.engine.request.text import TextStream


class _WholeStream:
    """The former TextStream: the whole output decoded at every step (the reference)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.sent = tokenizer, ""

    def delta(self, ids, final=False, cut=None) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        text = cut(text) if cut is not None else text
        if (not final and text.endswith("\ufffd")) or not text.startswith(self.sent):
            return ""
        out, self.sent = text[len(self.sent):], text
        return out


def test_incremental_deltas_equal_whole_decodes_step_by_step(decoder):
    tok = decoder.tokenizer
    rng = random.Random(0)
    texts = ["Voilà: naïve café, 東京タワー 🚀🎉 and ∑ x² ≤ ∞.", "def f(x):\n    return x ** 2  # ok\n\n\n",
             "  spaced   out  \t tabs", "Ünïcödé " * 5, "a" * 40 + " 😀" * 6]
    special = [i for i in (tok.eos_token_id, tok.bos_token_id) if i is not None]
    for case in range(40):
        ids = tok.encode(rng.choice(texts) + rng.choice(texts), add_special_tokens=False)
        if case % 3 == 0 and special:  # a special token in the middle: skipped in the text
            ids.insert(rng.randrange(len(ids)), special[0])
        if case % 4 == 0:  # raw byte tokens: single bytes of multi-byte characters
            ids += [rng.randrange(tok.vocab_size) for _ in range(6)]
        stops = StopChecker(tok, set(), ("ok", "🎉") if case % 2 else ())
        new, old, generated = TextStream(tok), _WholeStream(tok), []
        pos = 0
        while pos < len(ids):
            step = ids[pos: pos + rng.randint(1, 4)]
            pos += len(step)
            generated += step
            assert new.delta(generated, cut=stops.cut_text) == old.delta(generated, cut=stops.cut_text)
        assert new.sent == old.sent


def test_kept_special_ids_stay_in_the_text_and_the_stream_adds_up_to_it():
    """GenerationRequest.kept_special: a special token the reply is read for (Mistral's [TOOL_CALLS] after
    text) keeps its text, in the whole decode and in the stream's deltas; the other special tokens go."""
    from tests.services.openai.families import family_tokenizer
    from trserve.engine.request.text import reply_decoder

    tok = family_tokenizer("mistral")
    marker, inst = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[INST]"])
    before, after = tok.encode("Let me check the weather.", add_special_tokens=False), \
        tok.encode('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', add_special_tokens=False)
    ids = before + [inst, marker] + after + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == \
        'Let me check the weather.[{"name": "get_weather", "arguments": {"city": "Paris"}}]'  # the marker lost
    want = 'Let me check the weather.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert reply_decoder(tok, (marker,))(ids) == want
    assert reply_decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True)
    for size in (1, 2, 5):
        stream, sent = TextStream(tok, (marker,)), ""
        for end in range(size, len(ids) + size, size):
            sent += stream.delta(ids[:end])
        assert sent == want
