"""Streaming text with the real GPT-2 tokenizer: what a request shows is always a prefix of its
final text, never half a character or the start of a stop string, and the stop is left out."""

import pytest

from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.serve.stream import INCOMPLETE, TextStream

TOKENIZER = get_tokenizer("gpt2")


def _stream(tokens, **settings):
    """(the text shown after each token, the stream), until it finishes."""
    stream, shown = TextStream(TOKENIZER, **{"max_tokens": 100, **settings}), [""]
    for token in tokens:
        shown.append(shown[-1] + stream.push(token))
        if stream.finish_reason:
            break
    return shown, stream


def _check_prefixes(shown):
    final = shown[-1]
    for text in shown:
        assert final.startswith(text) and INCOMPLETE not in text, (text, final)


def test_a_stop_string_across_tokens_is_never_shown_and_is_left_out():
    tokens = TOKENIZER.encode("foo bar baz qux")
    assert TOKENIZER.decode(tokens[:1]) == "foo"  # the stop "o b" starts inside the first token
    shown, stream = _stream(tokens, stop=["o b", "never"])
    assert shown[-1] == "fo" and stream.finish_reason == "stop"
    _check_prefixes(shown)


def test_of_several_stop_strings_the_first_in_the_text_wins():
    """Two stops complete with the same token; the one that starts first in the text ends it,
    whichever comes first in the list, and nothing from there on is ever shown."""
    tokens = TOKENIZER.encode("hello world, and more")
    assert [TOKENIZER.decode([t]) for t in tokens[:2]] == ["hello", " world"]  # both stops end in " world"
    for stop in (["world", "lo w", "never"], ["lo w", "world"], ["never", "world", "lo wor", "lo w"]):
        shown, stream = _stream(tokens, stop=stop)
        assert shown == ["", "hel", "hel"] and stream.finish_reason == "stop", (stop, shown)
        _check_prefixes(shown)


def test_an_empty_stop_string_is_refused():
    """It would match before any text: refused, not ignored and not ending every request at once."""
    for stop in ([""], ["done", ""]):
        with pytest.raises(ValueError, match="a stop string is empty: it would end the request before any text"):
            TextStream(TOKENIZER, max_tokens=10, stop=stop)


def test_text_that_only_looked_like_a_stop_is_released():
    shown, stream = _stream(TOKENIZER.encode("one two three"), stop=["one tw!"], max_tokens=3)
    assert shown[-1] == "one two three" and stream.finish_reason == "length"
    assert shown[1] == ""  # "one" could still have become the stop
    _check_prefixes(shown)


def test_a_character_spelt_over_several_tokens_appears_whole():
    text = "smile 😀 and café ✓ done"
    tokens = TOKENIZER.encode(text)
    assert any(INCOMPLETE in TOKENIZER.decode(tokens[:k]) for k in range(len(tokens)))  # bytes split
    shown, stream = _stream(tokens)
    assert shown[-1] == text and stream.finish_reason is None
    _check_prefixes(shown)


def test_a_multibyte_stop_string_is_held_while_its_character_is_spelt():
    text = "go 😀 now"
    shown, stream = _stream(TOKENIZER.encode(text), stop=[" 😀"])
    assert shown[-1] == "go" and stream.finish_reason == "stop"
    _check_prefixes(shown)


def test_end_of_sequence_stops_unless_ignored():
    tokens = [*TOKENIZER.encode("hi"), TOKENIZER.eos_id, *TOKENIZER.encode(" there")]
    shown, stream = _stream(tokens)
    assert shown[-1] == "hi" and stream.finish_reason == "stop"
    shown, stream = _stream(tokens, ignore_eos=True)
    assert shown[-1] == "hi<|endoftext|> there" and stream.finish_reason is None


def test_limits_are_refused_clearly():
    with pytest.raises(ValueError, match="5 stop strings given; at most 4"):
        TextStream(TOKENIZER, max_tokens=10, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="max_tokens=0 must be at least 1"):
        TextStream(TOKENIZER, max_tokens=0)
    stream = TextStream(TOKENIZER, max_tokens=1)
    stream.push(TOKENIZER.encode("x")[0])
    with pytest.raises(ValueError, match="finished"):
        stream.push(1)


def test_each_token_decodes_a_few_tokens_not_the_whole_output():
    class Counting:  # the real tokenizer, recording how many ids each decode is given
        def __init__(self):
            self.stop_ids, self.lengths = TOKENIZER.stop_ids, []

        def decode(self, ids):
            self.lengths.append(len(ids))
            return TOKENIZER.decode(ids)

    text = "naïve café 😀 " * 90
    tokens, counting = TOKENIZER.encode(text), Counting()
    stream = TextStream(counting, max_tokens=len(tokens), stop=["never"])
    shown = "".join(stream.push(t) for t in tokens)
    assert shown == text and len(tokens) > 300
    assert max(counting.lengths) <= 4, max(counting.lengths)
