"""The request fields the server cannot honour: each passes at the values that ask for nothing (as
clients send them by default) and is refused, by name, at one that asks for something."""

import pytest

from jaxllm.serve.generation import RequestError
from jaxllm.serve.protocol import UNSUPPORTED, unsupported

# Written from OpenAI's and vLLM's documented defaults: (values that change nothing, one that does).
FIELDS = {
    "logit_bias": ([None, {}], {"5": 3}),
    "presence_penalty": ([None, 0, 0.0], 0.5),
    "frequency_penalty": ([None, 0], -1.0),
    "repetition_penalty": ([None, 1, 1.0], 1.2),
    "best_of": ([None, 1], 3),
    "suffix": ([None, ""], "end"),
    "functions": ([None, []], [{"name": "f"}]),
    "function_call": ([None, "none"], "auto"),
    "audio": ([None], {"voice": "alloy"}),
    "modalities": ([None, ["text"]], ["text", "audio"]),
    "min_tokens": ([None, 0], 4),
    "stop_token_ids": ([None, []], [2]),
    "bad_words": ([None, []], ["x"]),
    "allowed_token_ids": ([None], [1, 2]),
    "use_beam_search": ([None, False], True),
    "include_stop_str_in_output": ([None, False], True),
    "prompt_logprobs": ([None], 1),
    "truncate_prompt_tokens": ([None], 8),
    "guided_json": ([None], {"type": "object"}),
    "guided_regex": ([None], "a+"),
    "guided_choice": ([None], ["a", "b"]),
    "guided_grammar": ([None], "root ::= 'a'"),
}


def test_every_refused_field_is_listed_here():
    assert set(UNSUPPORTED) == set(FIELDS)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_field_passes_where_it_asks_for_nothing_and_is_refused_by_name_where_it_asks(field):
    harmless, asking = FIELDS[field]
    for value in harmless:
        unsupported({"model": "m", field: value})
    with pytest.raises(RequestError, match=f"^{field} is not supported by this server; ") as refused:
        unsupported({"model": "m", field: asking})
    assert refused.value.code == "unsupported_field" and refused.value.param == field
    fix = "give structured_outputs." if field.startswith("guided_") else "leave it out"
    assert fix in str(refused.value)
