"""Structured outputs and tool calls: on the engine's host side over a fake device that draws
uniformly among the tokens a row's mask allows (a model that ignores the grammar, so whatever it
draws must still parse), and through the HTTP API on 127.0.0.1 with the `openai` client. Every
output under a generated JSON schema parses and validates (`jsonschema`), sampled; constrained
rows share batches with unconstrained ones, whose tokens do not change; a grammar that cannot be
used is a 400 naming the field."""

import json
import re

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from support.docs import runnable_block
from support.fake_device import FakeDevice, fake_engine
from support.serving import http_server

from jaxllm.data.tokenizer import get_tokenizer
from jaxllm.serve import protocol
from jaxllm.serve.constraints import Grammars
from jaxllm.serve.generation import Request, RequestError
from jaxllm.serve.structured import Calls, constraint

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
           "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """A JSON schema whose every value is bounded (so a model that draws at random still ends)."""
    kinds = ["integer", "string", "enum", "boolean", "null", "const", "pattern"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    kind = kinds[rng.integers(len(kinds))]
    if kind == "integer":
        low = int(rng.integers(-1000, 1000))
        return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 5000))}
    if kind == "string":
        return {"type": "string", "minLength": int(rng.integers(0, 3)), "maxLength": int(rng.integers(3, 10))}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-z]{1,6}-[0-9]{2}$"}
    if kind == "enum":
        return {"enum": ["red", "green", 7, None, "tab\there", "quote\"d"][: int(rng.integers(1, 7))]}
    if kind == "const":
        return {"const": {"k": [1, "two"]}}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": int(rng.integers(0, 2)),
                "maxItems": int(rng.integers(2, 4))}  # fmt: skip
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = [f"field_{i}" for i in range(int(rng.integers(1, 4)))]
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}, "required": required,
            "additionalProperties": False}  # fmt: skip


def test_every_output_under_a_generated_schema_parses_and_validates(tokenizer, grammars):
    """60 generated schemas, two sampled choices each, batched beside unconstrained requests."""
    rng = np.random.default_rng(0)
    schemas = [random_schema(rng) for _ in range(60)]
    engine = fake_engine(tokenizer, slots=8)
    requests = [
        Request(tokenizer.encode(f"Answer {i}:"), 400, temperature=1.0, seed=i, n=2,
                constraint=grammars.json_schema(schema, "schema"))
        for i, schema in enumerate(schemas)
    ]  # fmt: skip
    for generation, schema in zip(engine.generate(requests), schemas, strict=True):
        for choice in generation.choices():
            assert choice.finish_reason == "stop", (schema, choice.text)
            jsonschema.validate(json.loads(choice.text), schema)
    assert engine.pool.in_use() == 0


def test_unconstrained_rows_draw_the_same_tokens_beside_constrained_ones(tokenizer, grammars):
    engine = fake_engine(tokenizer, slots=8)
    free = [Request(tokenizer.encode(f"Story {i}"), 30, temperature=t, seed=i) for i, t in enumerate((0.0, 1.0) * 2)]
    alone = [g.choices()[0].tokens for g in engine.generate(free)]
    digits = grammars.regex("[0-9]{40}", "regex")
    together = engine.generate([*free, *(Request([464, 318], 60, temperature=1.0, seed=s, constraint=digits)
                                        for s in range(4))])  # fmt: skip
    assert [g.choices()[0].tokens for g in together[:4]] == alone
    assert all(re.fullmatch("[0-9]{40}", g.choices()[0].text) for g in together[4:])


def test_the_tool_call_grammar_takes_calls_and_text_and_refuses_anything_else(tokenizer, grammars):
    """`auto`: an array of calls to the tools with their parameters, or text that does not start
    with '['; `required`: only calls."""
    body = protocol.ChatRequest(model="tiny", messages=MESSAGES, tools=TOOLS)
    auto = grammars.lark(Calls(body).lark(), "tools")
    required = grammars.lark(Calls(body.model_copy(update={"tool_choice": "required"})).lark(), "tools")

    def takes(constraint, text: str) -> bool:
        matcher = constraint.matcher()
        try:
            complete = [matcher.take(t) for t in tokenizer.encode(text)][-1]
        except RuntimeError:
            return False
        return complete or text[0] != "["  # text ends where the model draws eos

    call = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    assert takes(auto, call) and takes(auto, "It is sunny.") and takes(required, call)
    assert not takes(required, "It is sunny.")
    assert not takes(required, call.replace("[{", "[\n  {"))  # written compactly, as OpenAI's models write it
    compact = grammars.json_schema(WEATHER, "schema")
    assert takes(compact, call[1:-1].split('"arguments": ')[1][:-1])
    assert not takes(compact, '{ "city": "Paris", "unit": "celsius"}')
    for broken in ('[{"name": "get_time", "arguments": {}}]', '[{"name": "add", "arguments": {"a": 100, "b": 1}}]',
                   '[{"name": "add", "arguments": {"a": 1}}]', "[1]"):  # fmt: skip
        assert not takes(auto, broken), broken
    calls = Calls(body).read('[{"name": "add", "arguments": {"a": 2, "b": 3}}]')
    read = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert read == [("add", {"a": 2, "b": 3})]


def test_one_call_without_parallel_calls_and_free_text_under_tool_choice_none(tokenizer, grammars):
    """`parallel_tool_calls=false` holds the output to an array of exactly one call (two are
    refused, as with it on they are taken); `tool_choice: none` with tools constrains nothing."""
    body = protocol.ChatRequest(model="tiny", messages=MESSAGES, tools=TOOLS)
    one = '{"name": "add", "arguments": {"a": 1, "b": 2}}'

    def takes(request, text: str) -> bool:
        matcher = constraint(grammars, request).matcher()
        try:
            return [matcher.take(t) for t in tokenizer.encode(text)][-1]
        except RuntimeError:
            return False

    single = body.model_copy(update={"tool_choice": "required", "parallel_tool_calls": False})
    several = body.model_copy(update={"tool_choice": "required"})
    assert takes(single, f"[{one}]") and not takes(single, f"[{one}, {one}]")
    assert takes(several, f"[{one}, {one}]")
    free = body.model_copy(update={"tool_choice": "none"})
    assert constraint(grammars, free) is None and not Calls(free).active
    assert Calls(free).read(f"[{one}]") is None  # text that looks like a call stays text


@pytest.fixture(scope="module")
def server(tokenizer):
    with http_server(fake_engine(tokenizer, slots=4), model_name="tiny") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def test_the_serving_pages_example_runs(server, capsys):
    code = runnable_block("docs/serving.md", "structured-snippet").replace("http://127.0.0.1:8000", server)
    exec(compile(code, "docs/serving.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("author=") and re.fullmatch(r"[a-z]{3,8}@example\.com", out[1])
    assert out[2].startswith("get_weather {'city': ")


def test_response_formats_through_the_openai_client(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=120)

    parsed = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                            max_tokens=400, seed=2)  # fmt: skip
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_vllm_structured_outputs_on_completions_and_chats(client):
    def complete(spec, seed=0):
        answer = client.completions.create(model="tiny", prompt="Say:", max_tokens=60, seed=seed,
                                           extra_body={"structured_outputs": spec})  # fmt: skip
        return answer.choices[0].text

    for seed in range(3):
        assert re.fullmatch(r"[a-z]{2,8}@example\.com", complete({"regex": r"[a-z]{2,8}@example\.com"}, seed))
        assert complete({"choice": ["yes", "no", "maybe"]}, seed) in ("yes", "no", "maybe")
        sums = complete({"grammar": 'start: N " + " N\nN: /[0-9]{1,3}/'}, seed)
        assert re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3}", sums)
        schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}
        assert len(json.loads(complete({"json": schema}, seed))) == 2
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"structured_outputs": {
        "choice": ["sunny", "rainy"]}})  # fmt: skip
    assert chat.choices[0].message.content in ("sunny", "rainy")


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_tool_calls_whole_and_streamed(client):
    """`required` and a named function are answered with calls that the client reads (finish
    reason tool_calls), streamed as deltas the client assembles into the same calls; `none`
    answers in text, and a follow-up turn with the calls and their results renders."""
    for seed in range(3):
        whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               seed=seed, max_tokens=300)  # fmt: skip
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for name, arguments in _calls(choice.message):
            jsonschema.validate(arguments, next(t for t in TOOLS if t["function"]["name"] == name)["function"]
                                ["parameters"])  # fmt: skip
        with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            seed=seed, max_tokens=300) as stream:  # fmt: skip
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls" and _calls(streamed.message) == _calls(choice.message)

    named = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=300, seed=5,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False)  # fmt: skip
    assert [name for name, _ in _calls(named.choices[0].message)] == ["add"]
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", seed=5)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content is not None
    for seed in range(4):  # auto: calls, or text that is not one
        message = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=seed,
                                                 max_tokens=20).choices[0].message  # fmt: skip
        assert message.tool_calls or not message.content.startswith("[")
    call = named.choices[0].message.tool_calls[0]
    follow_up = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    assert client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=3).choices[0].message.content


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}, "required": ["a"]}}}},
     "response_format.json_schema.schema", "required property 'a' is unsatisfiable"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "Invalid type: objekt"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "is a JSON list; a schema is an object"),
    ({"structured_outputs": {"json": {"x-guidance": 5}}}, "structured_outputs.json", "not a JSON schema"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "give exactly one"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot be combined with tools"),
])  # fmt: skip
def test_a_grammar_that_cannot_be_used_is_a_400_naming_its_part(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=extra)
    error = refused.value.body
    assert error["param"] == param and re.search(words, error["message"]), error


def test_requests_a_constraint_cannot_serve_are_refused_by_name(client, grammars):
    with pytest.raises(openai.UnprocessableEntityError, match="not among the tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "fly"}})  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(openai.UnprocessableEntityError, match="the request has no tools"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice=choice)
    with pytest.raises(RequestError, match="ignore_eos cannot be set with a structured output"):
        fake_engine(get_tokenizer("gpt2")).limits.check(Request([1], 5, ignore_eos=True, constraint=grammars.regex(
            "a", "regex")))  # fmt: skip


class MegabyteDevice(FakeDevice):
    def decode_bytes(self, contexts):
        return 1e6


def test_the_bandwidth_gauge_is_bytes_per_step_over_step_time_over_the_devices(tokenizer):
    """A device that reads 1 MB a decode step, on a clock that moves 20 ms between reads."""
    engine = fake_engine(tokenizer)
    engine.device = MegabyteDevice(engine.slots, tokenizer.vocab_size)
    ticks = iter(np.arange(10_000) * 0.02)
    engine.clock = lambda: float(next(ticks))
    engine.generate([Request([1, 2], 120, temperature=1.0, seed=0, ignore_eos=True)])
    assert engine.stats().bandwidth_use == pytest.approx(1e6 / 0.02 / FakeDevice.bandwidth, rel=1e-3)
