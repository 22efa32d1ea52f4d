"""The HTTP API's contract, fuzzed. schemathesis reads the server's own /openapi.json and generates
requests for every operation, valid ones and ones that break the schema (hypothesis, a fixed
number of examples, derandomized), sent over HTTP to 127.0.0.1 where the app serves an engine
loaded from a checkpoint. Every answer must be a documented status, with a documented content
type and body (OpenAI's error body for refusals), and never a 5xx; afterwards /health is 200 and a
greedy request gives the text it gave before."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from support.serving import http_server

from jaxllm.serve.load import load_engine

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Not negative_data_rejection: the server's parsing is lenient (it takes "5" where the schema says an
# integer) and so it answers some schema-breaking bodies with a 200.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Examples per operation, in each mode that can break its schema: the generation routes run the
# model on the valid ones; the others take no input to break.
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
EXAMPLES = {"/v1/completions": (100, [POSITIVE, NEGATIVE]), "/v1/chat/completions": (100, [POSITIVE, NEGATIVE]),
            "/tokenize": (50, [POSITIVE, NEGATIVE]), "/detokenize": (50, [POSITIVE, NEGATIVE]),
            "/v1/models": (5, [POSITIVE]), "/health": (5, [POSITIVE])}  # fmt: skip
GREEDY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(trained):
    settings = {"serve.slots": 4, "model.max_seq_len": 64, "serve.max_len": 64, "serve.max_prompt_tokens": 32}
    engine = load_engine(trained[0], settings | {"serve.rate_per_s": 1e6, "serve.burst": 10**6})
    with http_server(engine, api_keys=[KEY]) as (url, server):
        yield url, server


def _fuzz(url: str, operation, mode: GenerationMode, examples: int) -> list[int]:
    statuses = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=url, headers=AUTH, timeout=120)
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text
        statuses.append(response.status_code)

    check()
    return statuses


def test_fuzzed_requests_get_documented_answers_and_leave_the_server_as_it_was(served):
    url, server = served
    before = httpx.post(f"{url}/v1/completions", json=GREEDY, headers=AUTH, timeout=60).json()["choices"][0]["text"]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    seen = {}
    for path, (examples, modes) in EXAMPLES.items():
        for method in schema[path]:
            for mode in modes:
                seen[method.upper(), path, mode.value] = _fuzz(url, schema[path][method], mode, examples)
    assert httpx.get(f"{url}/health").status_code == 200
    assert server.engine.failure is None and not server.engine.busy()
    after = httpx.post(f"{url}/v1/completions", json=GREEDY, headers=AUTH, timeout=60).json()["choices"][0]["text"]
    assert after == before
    # The fuzzing reached the model, and its refusals: valid bodies were served, invalid refused.
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert seen["POST", route, "positive"].count(200) >= 10, seen["POST", route, "positive"]
        assert {422} <= set(seen["POST", route, "negative"]), seen["POST", route, "negative"]
    for route in ("/tokenize", "/detokenize"):  # vLLM's routes refuse a field with a 400
        assert seen["POST", route, "positive"].count(200) >= 10, seen["POST", route, "positive"]
        assert {400} <= set(seen["POST", route, "negative"]), seen["POST", route, "negative"]
