"""What the server shares with vLLM's, over HTTP on 127.0.0.1 (an engine loaded from a checkpoint,
in this process, behind the API with a key): /tokenize and /detokenize (text as a completion's
prompt is tokenized, a chat as the chat route renders and tokenizes it, and every hostile body a
400 naming its field, or the body limit's 413), and vLLM's metric names in /metrics beside ours,
whose counts follow the requests made."""

import json
import subprocess

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.docs import runnable_block
from support.serving import http_server, metric_values, wait_for

from jaxllm.data.chat import ChatTemplate
from jaxllm.serve.load import load_engine

KEY, MODEL, VOCAB, MAX_LEN, MAX_PROMPT, PAGE = "vllm-key", "tiny", 300, 256, 200, 16
SETTINGS = {"serve.slots": 4, "model.max_seq_len": MAX_LEN, "serve.max_len": MAX_LEN,
            "serve.max_prompt_tokens": MAX_PROMPT, "serve.page_size": PAGE, "serve.rate_per_s": 1e6,
            "serve.burst": 10**6}  # fmt: skip
TEXTS = ["def read_config(path):\n    with open(path) as f:\n", "naïve café ✓ 漢字 — \t tabs\r\n", " ", ""]
CHAT = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Parse {\"a\": 1}."},
        {"role": "assistant", "content": "{\"a\": 1}"}, {"role": "user", "content": "And [2]?"}]  # fmt: skip


@pytest.fixture(scope="module")
def served(trained):
    engine = load_engine(trained[0], SETTINGS)
    with http_server(engine, api_keys=[KEY], model_name=MODEL) as (url, server):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            yield http, url, server


def _tokenizer(served):
    return served[2].tokenizer


def _post(http, path: str, body: dict) -> dict:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _metrics(http) -> dict[str, float]:
    """/metrics as {name[label values...]: value}, and vLLM's samples as {name[le]: value} once
    their labels are checked: model_name (the served model's id) and engine "0", as vLLM's."""
    text = http.get("/metrics").text
    values = metric_values(text)
    for sample in (s for family in text_string_to_metric_families(text) for s in family.samples):
        if sample.name.startswith("vllm:"):
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            assert labels == {"model_name": MODEL, "engine": "0"}, sample
            values[sample.name + ("" if le is None else f"[{le}]")] = sample.value
    return values


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_counts_as_the_tokenizer_and_the_completions_route_and_detokenize_gives_the_text_back(served, text):
    http, tokenizer = served[0], _tokenizer(served)
    tokenized = _post(http, "/tokenize", {"prompt": text})
    assert tokenized["tokens"] == tokenizer.encode(text) and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == MAX_LEN
    if text:  # the completions route counts the same prompt tokens
        done = _post(http, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
        assert done["usage"]["prompt_tokens"] == tokenized["count"]
        assert _post(http, "/detokenize", {"tokens": tokenized["tokens"]}) == {"prompt": text}


def test_text_starts_as_the_models_tokenizer_starts_a_prompt_unless_told_not_to(served, monkeypatch):
    """A tokenizer that puts a token first (a Llama's bos): /tokenize puts it first, as the
    completions route does (its usage counts it), and leaves it out with add_special_tokens false."""
    http, tokenizer = served[0], _tokenizer(served)
    monkeypatch.setattr(tokenizer, "prompt_prefix", (7,))
    text = TEXTS[0]
    assert _post(http, "/tokenize", {"prompt": text})["tokens"] == [7, *tokenizer.encode(text)]
    plain = _post(http, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode(text)
    done = _post(http, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
    assert done["usage"]["prompt_tokens"] == plain["count"] + 1
    chat = _post(http, "/tokenize", {"messages": CHAT})["tokens"]
    assert _post(http, "/tokenize", {"messages": CHAT, "add_special_tokens": True})["tokens"] == [7, *chat]


def test_a_chat_tokenizes_as_the_chat_route_renders_it(served):
    """The ids of the template's rendering (with the generation prompt, unless asked without),
    as many as a real chat completion's prompt_tokens."""
    http, tokenizer = served[0], _tokenizer(served)
    tokenized = _post(http, "/tokenize", {"messages": CHAT})
    assert tokenized["tokens"] == tokenizer.encode_special(ChatTemplate().render(CHAT))
    done = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0})
    assert done["usage"]["prompt_tokens"] == tokenized["count"]
    parts = [{**m, "content": [{"type": "text", "text": m["content"][:3]}, {"type": "text", "text": m["content"][3:]}]}
             for m in CHAT]  # fmt: skip
    assert _post(http, "/tokenize", {"messages": parts})["tokens"] == tokenized["tokens"]
    bare = _post(http, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"]
    assert bare == tokenizer.encode_special(ChatTemplate().render(CHAT, add_generation_prompt=False))
    assert bare != tokenized["tokens"]
    assert _post(http, "/detokenize", {"tokens": tokenized["tokens"]})["prompt"] == ChatTemplate().render(CHAT)


def test_a_chats_tools_are_rendered_as_the_chat_route_renders_them(served, monkeypatch):
    http, server = served[0], served[2]
    template = ChatTemplate(
        "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    monkeypatch.setattr(server, "chat", template)
    tool = {"type": "function", "function": {"name": "parse", "parameters": {"type": "object", "properties": {}}}}
    tokenized = _post(http, "/tokenize", {"messages": CHAT[1:2], "tools": [tool]})
    assert tokenized["tokens"] == server.tokenizer.encode_special(template.render(CHAT[1:2], True, [tool]))
    assert tokenized["tokens"] != _post(http, "/tokenize", {"messages": CHAT[1:2]})["tokens"]
    body = {"messages": CHAT[1:2], "tools": [tool], "tool_choice": "none", "max_tokens": 2, "temperature": 0}
    assert _post(http, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == tokenized["count"]


VOCAB_HINT = f"[0, {VOCAB})"
HOSTILE = [  # (route, body less the model, param, words of the message)
    ("/detokenize", {"tokens": []}, "tokens", "at least 1 item"),
    ("/detokenize", {"tokens": [5, VOCAB]}, "tokens.1", VOCAB_HINT),
    ("/detokenize", {"tokens": [-1]}, "tokens.0", VOCAB_HINT),
    ("/detokenize", {"tokens": [2**31]}, "tokens.0", VOCAB_HINT),
    ("/detokenize", {"tokens": [2**63 + 1]}, "tokens.0", VOCAB_HINT),
    ("/detokenize", {"tokens": [10**40]}, "tokens.0", VOCAB_HINT),
    ("/detokenize", {"tokens": [1.5]}, "tokens.0", "valid integer"),
    ("/detokenize", {"tokens": [1.0]}, "tokens.0", "valid integer"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0", "valid integer"),
    ("/detokenize", {"tokens": [True]}, "tokens.0", "valid integer"),
    ("/detokenize", {"tokens": [None]}, "tokens.0", "valid integer"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens", "valid list"),
    ("/detokenize", {}, "tokens", "required"),
    ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "valid string"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "lone surrogate"),
    ("/tokenize", {}, "prompt", "required"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs", "leave it out"),
    ("/tokenize", {"messages": []}, "messages", "at least 1 item"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages.0.role", "'user'"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message", "leave it out"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template", "leave it out"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "required"),
]


@pytest.mark.parametrize("route,body,param,words", HOSTILE)
def test_a_hostile_body_is_a_400_naming_its_field(served, route, body, param, words):
    http = served[0]

    def refused() -> float:
        metrics = _metrics(http)
        return sum(metrics.get(f"jaxllm_rejections_total[{r}]", 0) for r in ("invalid", "unsupported_field"))

    before = refused()
    response = http.post(route, content=json.dumps({"model": MODEL, **body}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert refused() == before + 1 and _metrics(http)[f"jaxllm_requests_total[{route}][400]"] >= 1


def test_the_guards_before_the_body_hold_and_long_prompts_tokenize_under_the_body_limit(served):
    """No key: 401. Another model: 404. Over serve.max_body_bytes: 413. Not JSON: 400. A prompt
    far over serve.max_prompt_tokens, inside the body limit, is tokenized all the same."""
    http, url, server = served
    tokenizer = server.tokenizer
    for route, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(f"{url}{route}", json={"model": MODEL, **body}).status_code == 401
        other = http.post(route, json={"model": "gpt-4", **body})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model", other.text
        assert http.post(route, content=b"{not json").status_code == 400
    limit = server.settings.max_body_bytes
    huge = http.post("/tokenize", json={"model": MODEL, "prompt": "a" * limit})
    assert huge.status_code == 413 and "serve.max_body_bytes" in huge.text, huge.text
    assert http.post("/detokenize", json={"model": MODEL, "tokens": [1] * (limit // 2)}).status_code == 413
    text = TEXTS[0] * 2000  # ~100 KB, thousands of tokens
    tokenized = _post(http, "/tokenize", {"prompt": text})
    assert tokenized["count"] == len(tokenizer.encode(text)) > MAX_PROMPT
    assert _post(http, "/detokenize", {"tokens": tokenized["tokens"]})["prompt"] == text


def test_both_routes_answer_while_the_engine_compiles(served, monkeypatch):
    http, _, server = served
    monkeypatch.setattr(server, "engine", None)  # as before the engine is ready
    assert http.get("/health").status_code == 503
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 503
    assert _post(http, "/detokenize", {"tokens": _post(http, "/tokenize", {"prompt": "abc"})["tokens"]}) == {
        "prompt": "abc"
    }


def test_the_openapi_document_declares_both_routes(served):
    http = served[0]
    document = http.get("/openapi.json").json()
    tokenize, detokenize = document["paths"]["/tokenize"]["post"], document["paths"]["/detokenize"]["post"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in tokenize["requestBody"]["content"]["application/json"]["schema"]
            ["anyOf"]} == {"TokenizeCompletionRequest", "TokenizeChatRequest"}  # fmt: skip
    token = document["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token == {"type": "integer", "minimum": 0, "exclusiveMaximum": VOCAB}
    assert {"200", "400", "401", "404", "413"} <= set(tokenize["responses"]) & set(detokenize["responses"])
    assert "503" not in tokenize["responses"]  # no engine needed


def test_the_docs_tokenize_example_runs_against_the_server(served):
    url = served[1]
    script = runnable_block("docs/serving.md", "tokenize-snippet")
    script = script.replace("http://127.0.0.1:8000", url).replace("curl ", f"curl -H 'Authorization: Bearer {KEY}' ")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, check=True)
    tokenized, text = map(json.loads, out.stdout.split("\n", 1))
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == MAX_LEN
    assert text == {"prompt": "def read_config(path):"}


def test_vllm_metrics_count_the_requests_made(served):
    """After completions (whole and streamed, n=2, and a list of two prompts), each vLLM histogram
    counts what vLLM's would: a first token and a queue time per prompt, and a gap per token after
    a choice's first; ours count the same; the KV cache's use is a fraction, 0 when idle."""
    http = served[0]
    before = _metrics(http)
    made = [({"prompt": [5, 6, 7], "max_tokens": 6}, 1, [6]),
            ({"prompt": [8, 9], "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1}, 1, [4, 4]),
            ({"prompt": [[10, 11], [12]], "max_tokens": 3}, 2, [3, 3]),
            ({"prompt": [13, 14], "max_tokens": 5, "stream": True}, 1, [5])]  # fmt: skip
    for body, _, tokens in made:
        body = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if not body.get("stream"):
            assert response.json()["usage"]["completion_tokens"] == sum(tokens)
    after = _metrics(http)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompts = sum(p for _, p, _ in made)
    gaps = sum(t - 1 for _, _, tokens in made for t in tokens)
    assert grew("vllm:time_to_first_token_seconds_count") == prompts
    assert grew("vllm:request_queue_time_seconds_count") == prompts
    assert grew("vllm:inter_token_latency_seconds_count") == gaps
    assert grew("jaxllm_time_to_first_token_seconds_count") == prompts  # ours, from the same observations
    assert grew("jaxllm_time_per_output_token_seconds_count") == sum(len(t) for _, _, t in made)
    assert 0 < grew("vllm:time_to_first_token_seconds_sum") < 60
    queued, first = (grew(f"vllm:{n}_seconds_sum") for n in ("request_queue_time", "time_to_first_token"))
    assert 0 <= queued < first  # each admitted before its first token
    assert 0 < grew("vllm:inter_token_latency_seconds_sum")
    assert grew("vllm:inter_token_latency_seconds_bucket[+Inf]") == gaps
    wait_for(lambda: _metrics(http)["jaxllm_kv_cache_usage"] == 0, 30)  # every sequence's pages back
    assert _metrics(http)["vllm:kv_cache_usage_perc"] == 0


def test_vllm_kv_cache_usage_is_ours_as_a_fraction_while_requests_run(served):
    """While a long request decodes, vLLM's gauge reads what ours does, a fraction in (0, 1]."""
    http, url = served[0], served[1]
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": MAX_LEN - 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=http.headers, timeout=120) as streamed:
        lines = streamed.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # decoding now
        seen = _metrics(http)
        for _ in lines:
            pass
    assert 0 < seen["vllm:kv_cache_usage_perc"] == seen["jaxllm_kv_cache_usage"] <= 1


def test_vllm_prefix_cache_counters_count_tokens_and_grow_when_a_prompt_comes_again(served):
    """A 50-token prompt sent twice: three full pages queried each time, found the second
    (vLLM counts tokens: a page's worth for each page), beside our page counts."""
    http, url = served[0], served[1]
    prompt = np.random.default_rng(11).integers(0, VOCAB, 50).tolist()
    seen = [_metrics(http)]
    for _ in range(2):
        _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
        seen.append(_metrics(http))
    queries, hits = ([m[name] for m in seen] for name in ("vllm:prefix_cache_queries_total",
                                                           "vllm:prefix_cache_hits_total"))  # fmt: skip
    pages = (50 - 1) // PAGE
    assert np.diff(queries).tolist() == [pages * PAGE] * 2 and np.diff(hits).tolist() == [0, pages * PAGE]
    ours = [m["jaxllm_prefix_cache_hit_pages"] for m in seen]
    assert np.diff(ours).tolist() == [0, pages]
    families = httpx.get(f"{url}/metrics").text  # no key needed, as before
    for kind in ("vllm:prefix_cache_queries_total counter", "vllm:prefix_cache_hits_total counter",
                 "vllm:kv_cache_usage_perc gauge", "vllm:inter_token_latency_seconds histogram"):  # fmt: skip
        assert f"# TYPE {kind}\n" in families
