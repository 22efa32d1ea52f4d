"""The HTTP API as clients meet it: `python -m jaxllm.serve` on 127.0.0.1 serving a tiny model
trained on real text, driven by the official `openai` client and by raw HTTP. Log-probs are
checked against a full recompute of the checkpoint's params; every guard's status, message and
metric; a flood of malformed requests leaves the server as it was."""

import collections
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
from support.docs import runnable_block
from support.runs import checkpoint_params, run, train_command
from support.serving import metric_values, serve_process, wait_for

from jaxllm.checkpoint import load_params, stored_config
from jaxllm.data.tokenizer import load_saved_tokenizer
from jaxllm.model.cache import KVCache
from jaxllm.model.decoder import Model
from jaxllm.serve.mappings import HEADROOM, kernel_limit

pytestmark = pytest.mark.minutes(5)  # about 5 min on 2 cores: scheduled first (tests/conftest.py)

KEY, RATE_KEY, FLOOD_KEY = "key-main", "key-rate", "key-flood"
BURST, SLOTS, QUEUE, MAX_LEN, MAX_PROMPT = 400, 8, 8, 256, 128
PPL_ALARM = 1000  # the training corpus reads at a perplexity of ~100-200 here, random tokens at ~2000
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system messages here') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
)
PROMPT = "def read_config(path):\n    with open(path) as f:\n"
PROMPTS = ["import json\n", "class Parser:\n    def", "def main():\n    ", "    return self.", "from email import",
           "    if not line:\n", "# Copyright", "def __init__(self"]  # fmt: skip


class Client:
    """Raw HTTP to the server, for what the openai client would refuse to send."""

    def __init__(self, port: int, source: str = "127.0.0.1"):
        self.port, self.source = port, source

    def request(self, method, path, body=b"", key=KEY, headers=None):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120, source_address=(self.source, 0))
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                   **(headers or {})}  # fmt: skip
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            connection.request(method, path, body, headers)
        except (BrokenPipeError, ConnectionResetError):  # it answered before reading the whole body
            pass
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, json.loads(data) if data.startswith(b"{") else data, response.headers

    def complete(self, body, **kwargs):
        return self.request("POST", "/v1/completions", {"model": "tiny", **body}, **kwargs)

    def metrics(self) -> dict[str, float]:
        return metric_values(self.request("GET", "/metrics")[1].decode())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 40-step run on the stdlib's email and json sources, served with API keys, a deny-list,
    a chat template file, a small queue and the perplexity alarm refusing."""
    root = tmp_path_factory.mktemp("api")
    workdir = root / "run"
    run(train_command(workdir, "--config.train.steps=40", "--config.data.eval_every=40"))
    (root / "keys").write_text(f"# keys\n{KEY}\n{RATE_KEY}\n{FLOOD_KEY}\n")
    (root / "deny").write_text("# refused\nforbidden\\s+word\n")
    (root / "chat.jinja").write_text(TEMPLATE)
    flags = [
        "--api-keys", str(root / "keys"), "--deny", str(root / "deny"), "--chat-template", str(root / "chat.jinja"),
        f"--config.serve.slots={SLOTS}", f"--config.serve.max_len={MAX_LEN}",
        f"--config.serve.max_prompt_tokens={MAX_PROMPT}", f"--config.serve.max_queue={QUEUE}",
        "--config.serve.rate_per_s=2", f"--config.serve.burst={BURST}", f"--config.serve.ppl_alarm={PPL_ALARM}",
        "--config.serve.ppl_reject=true", "--config.serve.model_name=tiny",
    ]  # fmt: skip
    log = root / "server.log"
    with serve_process(["--workdir", workdir], log, *flags) as (port, statuses):
        assert (503, 0) in [s[:2] for s in statuses] and statuses[-1][:2] == (200, 1), f"up early: {statuses}"
        _check_start_up(statuses, log.read_text(), cached=False)
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        tokenizer = load_saved_tokenizer(workdir / "tokenizer")
        yield {"client": Client(port), "sdk": sdk, "workdir": workdir, "log": log, "port": port,
               "tokenizer": tokenizer, "flags": flags}  # fmt: skip


def _check_start_up(statuses, log: str, cached: bool) -> None:
    """While it starts, /health says so with the steps compiled so far, counting up to all of
    them; the log gives the start-up time, how many steps the compilation cache held, and the
    memory mappings the process holds of the kernel's limit."""
    starting = [body for status, _, body in statuses if status == 503]
    assert starting and all(body["status"] == "starting" for body in starting)
    compiled = [body["compiled"] for body in starting]
    assert compiled == sorted(compiled) and all(body["compiled"] <= body["steps"] for body in starting)
    steps, read = map(int, re.search(r"serve: (\d+) steps ready in [\d.]+ s, (\d+) of them read from", log).groups())
    assert steps > 10 and read == (steps if cached else 0), log
    if kernel_limit() is not None:  # Linux
        held, limit = (int(n.replace(",", "")) for n in re.search(
            r"the process holds ([\d,]+) memory mappings of the ([\d,]+) the kernel allows", log).groups())  # fmt: skip
        assert limit == kernel_limit() and 0 < held < HEADROOM * limit, log
    assert re.search(r"ready at http://127\.0\.0\.1:\d+/v1 in [\d.]+ s", log)


@pytest.fixture(scope="module")
def reference(served):
    """Each position's log-probs by a full forward pass of the checkpoint's params, here."""
    cfg = stored_config(served["workdir"])
    params = checkpoint_params(served["workdir"], cfg.train.steps)
    step = jax.jit(lambda tokens: jax.nn.log_softmax(Model(cfg.model).logits(params, tokens[None])[0]))

    def logprobs(ids):
        padded = np.zeros(64, np.int32)  # one compile; causal, so the padding changes nothing before it
        padded[: len(ids)] = ids
        return np.asarray(step(padded))[: len(ids)]

    return logprobs


def greedy(sdk, prompt, n=16, **kwargs):
    return sdk.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, **kwargs)


def test_min_p_of_one_samples_the_greedy_text(served):
    """vLLM's min_p, through each slot's settings on the device: at 1 only the likeliest token is
    left at every step, so a hot sampled request writes greedy decoding's text; at 0 it does not."""
    sdk, hot = served["sdk"], dict(temperature=1.5, max_tokens=24, extra_body={"ignore_eos": True})
    want = greedy(sdk, PROMPT, 24, extra_body={"ignore_eos": True}).choices[0].text
    for seed in (1, 2):
        cut = sdk.completions.create(model="tiny", prompt=PROMPT, seed=seed, **{**hot, "extra_body": {
            "ignore_eos": True, "min_p": 1.0}})  # fmt: skip
        assert cut.choices[0].text == want
    free = [sdk.completions.create(model="tiny", prompt=PROMPT, seed=seed, **hot).choices[0].text for seed in (1, 2)]
    assert want not in free


def test_greedy_text_and_logprobs_equal_a_full_recompute(served, reference):
    """The echoed prompt's and each generated token's log-prob and top 5 equal the recompute's."""
    tokenizer = served["tokenizer"]
    ids = tokenizer.encode(PROMPT)
    start = len(ids)
    for _ in range(12):
        ids.append(int(np.argmax(reference(ids)[-1])))
    want = reference(ids)
    done = greedy(served["sdk"], PROMPT, 12, logprobs=5, echo=True, extra_body={"ignore_eos": True})
    choice = done.choices[0]
    assert choice.text == PROMPT + tokenizer.decode(ids[start:])
    got = choice.logprobs
    assert got.token_logprobs[0] is None and len(got.token_logprobs) == len(ids)
    np.testing.assert_allclose(got.token_logprobs[1:], want[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)
    for i in range(1, len(ids)):
        top = sorted(got.top_logprobs[i].values(), reverse=True)
        np.testing.assert_allclose(top, np.sort(want[i - 1])[::-1][: len(top)], atol=2e-4)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (start, 12)


def test_streamed_deltas_join_to_the_whole_text_and_usage(served):
    sdk = served["sdk"]
    whole = greedy(sdk, PROMPT, 20, logprobs=2)
    chunks = list(greedy(sdk, PROMPT, 20, logprobs=2, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed_tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed_tokens == whole.choices[0].logprobs.tokens
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump() and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    messages = [{"role": "user", "content": "Write a parser."}]
    chat = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    stream = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_chat_renders_the_template_file(served):
    """A chat completion equals the completion of the template's rendering; the template's own
    refusal (a system message) is a 422 with its message."""
    sdk = served["sdk"]
    parts = [{"type": "text", "text": "Now "}, {"type": "text", "text": "the body."}]
    messages = [{"role": "user", "content": "Parse this header."}, {"role": "assistant", "content": "OK"},
                {"role": "user", "content": parts}]  # fmt: skip
    chat = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=3)  # fmt: skip
    rendered = "<user>Parse this header.\n<assistant>OK\n<user>Now the body.\n<assistant>"
    plain = greedy(sdk, rendered, 16, logprobs=3)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert [t.token for t in chat.choices[0].logprobs.content] == plain.choices[0].logprobs.tokens
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.UnprocessableEntityError, match="no system messages here"):
        sdk.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."}])


def test_stop_string_spanning_a_token_boundary(served):
    """A stop string made of one token's last character and the next one's first ends the text
    just before it, streamed or not."""
    sdk = served["sdk"]
    full = greedy(sdk, PROMPT, 32, logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    tokens, text = full.logprobs.tokens, full.text
    for k in range(len(tokens) - 1):
        stop = tokens[k][-1:] + tokens[k + 1][:1]
        cut = sum(len(t) for t in tokens[: k + 1]) - 1
        if len(stop) == 2 and text.find(stop) == cut:
            break
    else:
        pytest.fail(f"no stop string spans a token boundary in {tokens}")
    go_on = {"ignore_eos": True}
    stopped = greedy(sdk, PROMPT, 32, stop=[stop], extra_body=go_on).choices[0]
    assert (stopped.text, stopped.finish_reason) == (text[:cut], "stop")
    streamed = greedy(sdk, PROMPT, 32, stop=stop, stream=True, extra_body=go_on)
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]


def test_a_list_of_prompts_gives_each_its_choices(served):
    """Prompt p's choice c has index p * n + c and is what the prompt gives alone."""
    sdk, tokenizer = served["sdk"], served["tokenizer"]
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode(PROMPTS[0])]
    both = sdk.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=10,
        n=2,
        seed=3,
        temperature=0.9,
        extra_body={"a_field_no_one_knows": [1]},
    )  # ignored, as OpenAI's clients expect
    for p, prompt in enumerate(prompts):
        alone = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=10, n=2, seed=3, temperature=0.9)
        want = {c.index: c.text for c in alone.choices}
        assert {c.index - 2 * p: c.text for c in both.choices if c.index // 2 == p} == want
    assert both.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])


def test_docs_examples_run_against_the_server(served):
    """The serving page's curl and openai-client examples, pointed at this server and its key."""
    port, auth = served["port"], f"-H 'Authorization: Bearer {KEY}'"
    curl = runnable_block("docs/serving.md", "curl-snippet")
    curl = curl.replace("8000", str(port)).replace("curl ", f"curl {auth} ")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", curl], capture_output=True, text=True, check=True).stdout
    assert '"object":"text_completion"' in out and out.rstrip().endswith("data: [DONE]")
    client = runnable_block("docs/serving.md", "openai-snippet")
    client = client.replace("8000", str(port)).replace('"unused-without-keys"', repr(KEY))
    out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, check=True).stdout
    assert out


def test_n_choices_and_seeds(served):
    sdk = served["sdk"]

    def sample(seed):
        done = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=3, seed=seed, temperature=1.0)
        return [c.text for c in sorted(done.choices, key=lambda c: c.index)]

    first = sample(5)
    assert sample(5) == first and sample(6) != first and len(set(first)) > 1


def _concurrent(served, bodies, stagger=0.02):
    results = [None] * len(bodies)

    def send(i):
        time.sleep(i * stagger)
        results[i] = served["client"].complete(bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_eight_concurrent_requests_equal_each_alone(served):
    """Greedy and seeded requests with staggered starts decode together (a step with at least 5
    busy slots) and give what each gives alone."""
    client = served["client"]
    bodies = [{"prompt": p, "max_tokens": 40, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
              for i, p in enumerate(PROMPTS)]  # fmt: skip
    alone = [client.complete(b)[1]["choices"][0]["text"] for b in bodies]
    before = client.metrics()
    together = _concurrent(served, bodies)
    assert [r[1]["choices"][0]["text"] for r in together] == alone
    after = client.metrics()
    wide = [m["jaxllm_decode_step_slots_count"] - m["jaxllm_decode_step_slots_bucket[4.0]"] for m in (before, after)]
    assert wide[1] > wide[0], "no decode step had 5 or more busy slots"


def _error(status, body, want_status, pattern, code=None):
    assert status == want_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and re.search(pattern, error["message"]), error
    assert code is None or error["code"] == code, error


# (name, method, path, body, key, status, message pattern, error code, metric reason)
GUARDS = [
    ("too large", "POST", "/v1/completions", b"x" * (10 << 20), KEY, 413, r"1048576 bytes \(serve.max_body_bytes\)",
     "request_too_large", "body_too_large"),
    ("no key", "GET", "/v1/models", b"", None, 401, "Authorization: Bearer", "invalid_api_key", "auth"),
    ("wrong key", "POST", "/v1/completions", {"model": "tiny", "prompt": "x"}, "nope", 401, "API key",
     "invalid_api_key", "auth"),
    ("bad json", "POST", "/v1/completions", b'{"model": "tiny", "prompt":', KEY, 400, "not JSON", "invalid_json",
     "bad_json"),
    ("bad utf-8", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', KEY, 400, "not JSON",
     "invalid_json", "bad_json"),
    ("deep nesting", "POST", "/v1/completions", b"[" * 100000 + b"]" * 100000, KEY, 400, "recursion",
     "invalid_json", "bad_json"),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", KEY, 422, "JSON list", None, "invalid"),
    ("nan", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', KEY, 422,
     "^temperature: .*finite", "invalid_value", "invalid"),
    ("wrong type", "POST", "/v1/completions", {"model": "tiny", "prompt": {"a": 1}}, KEY, 422, "^prompt",
     "invalid_value", "invalid"),
    ("lone surrogate", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800"}', KEY, 422,
     "lone surrogate", "invalid_value", "invalid"),
    ("id out of vocab", "POST", "/v1/completions", {"model": "tiny", "prompt": [5, 512]}, KEY, 422,
     r"^prompt.1: .* less than 512 \(.*ids below the vocabulary's size\)",
     "invalid_value", "invalid"),
    ("negative id", "POST", "/v1/completions", {"model": "tiny", "prompt": [-1]}, KEY, 422,
     "^prompt.0: .* greater than or equal to 0",
     "invalid_value", "invalid"),
    ("huge n", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 10**12}, KEY, 422,
     r"^n: .* less than or equal to 8 \(serve.slots\)", "invalid_value", "invalid"),
    ("huge top_k", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 1099511627776}, KEY, 422,
     r"^top_k: .* less than or equal to 512 \(the vocabulary's size\)", "invalid_value", "invalid"),
    ("n past int64", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
     "n": 2**70}, KEY, 422, "^n: ", "invalid_value", "invalid"),
    ("seed past uint32", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**32}, KEY, 422,
     r"^seed: .* less than 4294967296 \(2\*\*32\)", "invalid_value", "invalid"),
    ("negative seed", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "seed": -1}, KEY, 422,
     "^seed: .* greater than or equal to 0", "invalid_value", "invalid"),
    ("infinity", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', KEY, 422,
     "^top_p: .*finite", "invalid_value", "invalid"),
    ("5000-digit int", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 1' + b"0" * 5000 + b"}",
     KEY, 400, "not JSON", "invalid_json", "bad_json"),
    ("huge max_tokens", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**12}, KEY,
     422, rf"^max_tokens: .*{MAX_LEN - 1} \(serve.max_len less one\)", "invalid_value", "invalid"),
    ("long id prompt", "POST", "/v1/completions", {"model": "tiny", "prompt": [7] * 200, "max_tokens": 3}, KEY, 422,
     rf"^prompt: .*at most {MAX_PROMPT} items.*serve.max_prompt_tokens", "invalid_value", "invalid"),
    ("over the context", "POST", "/v1/completions", {"model": "tiny", "prompt": [7] * 100, "max_tokens": 200}, KEY,
     422, rf"100 tokens and max_tokens is 200.*{MAX_PROMPT}.*{MAX_LEN}", "context_length_exceeded",
     "context_length"),
    ("long text prompt", "POST", "/v1/completions", {"model": "tiny", "prompt": "words " * 1000}, KEY, 422,
     rf"at most {MAX_PROMPT} tokens", "context_length_exceeded", "context_length"),
    ("1 MB prompt", "POST", "/v1/completions", {"model": "tiny", "prompt": "a" * 1_000_000}, KEY, 422,
     rf"at most {MAX_PROMPT} tokens", "context_length_exceeded", "context_length"),
    ("1 MB model name", "POST", "/v1/completions", {"model": "m" * 1_000_000, "prompt": "x"}, KEY, 404,
     "^model 'm{64}…' is not served", "model_not_found", "unknown_model"),
    ("too many prompts", "POST", "/v1/completions", {"model": "tiny", "prompt": ["x"] * 9}, KEY, 422,
     r"^prompt: .*at most 8 items", "invalid_value", "invalid"),
    ("too many stops", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "stop": list("abcde")}, KEY, 422,
     r"^stop: .*at most 4 items", "invalid_value", "invalid"),
    ("empty stop", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["done", ""]}, KEY, 422,
     r"^stop\.1: .*a stop string is empty: it would end the request before any text", "invalid_value", "invalid"),
    ("empty stop chat", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
     "content": "x"}], "stop": ""}, KEY, 422, r"^stop\.0: .*a stop string is empty", "invalid_value", "invalid"),
    ("surrogate stop", "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content":'
     b' "x"}], "stop": ["\\udfff"]}', KEY, 422, "lone surrogate", "invalid_value", "invalid"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, KEY, 404, "'gpt-9' is not served",
     "model_not_found", "unknown_model"),
    ("logit_bias", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 3}}, KEY, 422,
     "^logit_bias is not supported", "unsupported_field", "unsupported_field"),
    ("penalty", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
     "frequency_penalty": 0.5}, KEY, 422, "^frequency_penalty", "unsupported_field", "unsupported_field"),
    ("tool without function", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
     "content": "x"}], "tools": [{"type": "function"}]}, KEY, 422, "^tools.0.function", "invalid_value", "invalid"),
    ("unsatisfiable schema", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
     "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
     "type": "integer", "minimum": 3, "maximum": 1}}}}, KEY, 400, "^response_format.json_schema.schema: .*minimum",
     "invalid_schema", "invalid_grammar"),
    ("best_of", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3}, KEY, 422, "^best_of",
     "unsupported_field", "unsupported_field"),
    ("min_tokens", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 4}, KEY, 422,
     "^min_tokens is not supported by this server; leave it out", "unsupported_field", "unsupported_field"),
    ("guided_json", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
     "guided_json": {"type": "object"}}, KEY, 422, "^guided_json is not supported .*structured_outputs.json instead",
     "unsupported_field", "unsupported_field"),
    ("unknown role", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot",
     "content": "x"}]}, KEY, 422, "^messages.0.role", "invalid_value", "invalid"),
    ("image", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
     {"type": "image_url", "image_url": {"url": "x"}}]}]}, KEY, 422, "^messages.0.content", "invalid_value",
     "invalid"),
    ("deny-list", "POST", "/v1/completions", {"model": "tiny", "prompt": "say ＦＯＲＢＩＤＤＥＮ\tWord now"}, KEY, 400,
     "content policy", "content_policy_violation", "deny_list"),
    ("deny-list ids", "POST", "/v1/completions", {"model": "tiny", "prompt": "TOKENS:forbidden word"}, KEY, 400,
     "content policy", "content_policy_violation", "deny_list"),
    ("deny-list chat", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
     {"type": "text", "text": "a forbidden "}, {"type": "text", "text": "WORD"}]}]}, KEY, 400, "content policy",
     "content_policy_violation", "deny_list"),
    ("no route", "GET", "/v1/engines", b"", KEY, 404, "Not Found", None, "no_route"),
]  # fmt: skip


def _send(served, guard, main_key=KEY):
    """The guard's request; with `main_key` in place of the main key (a bucket of its own)."""
    name, method, path, body, key, *_ = guard
    key = main_key if key == KEY else key
    if isinstance(body, dict) and body.get("prompt") == "TOKENS:forbidden word":  # the same text as token ids
        body = {**body, "prompt": served["tokenizer"].encode("forbidden word")}
    return served["client"].request(method, path, body, key=key)


@pytest.mark.parametrize("guard", GUARDS, ids=[g[0] for g in GUARDS])
def test_guard_answers_with_its_status_message_and_metric(served, guard):
    *_, status, pattern, code, reason = guard
    client = served["client"]
    before = client.metrics().get(f"jaxllm_rejections_total[{reason}]", 0)
    _error(*_send(served, guard)[:2], status, pattern, code)
    assert client.metrics()[f"jaxllm_rejections_total[{reason}]"] == before + 1


def test_fields_it_cannot_honour_pass_where_their_values_ask_for_nothing(served):
    """vLLM's and OpenAI's clients may send them at their defaults."""
    defaults = {"min_p": 0, "min_tokens": 0, "stop_token_ids": [], "use_beam_search": False, "guided_json": None,
                "presence_penalty": 0, "repetition_penalty": 1, "best_of": 1, "logit_bias": {}}  # fmt: skip
    status, body, _ = served["client"].request(
        "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, **defaults}, key=KEY
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_rate_limit_answers_429_with_retry_after(served):
    """RATE_KEY spends its burst; the next request waits, whatever the other key does, and
    whatever else is wrong with it (an oversized or malformed body)."""
    client = served["client"]
    refused = client.metrics().get("jaxllm_rejections_total[rate_limited]", 0)
    answers = []  # every (status, body, headers) RATE_KEY is given

    def spend():
        """Requests until one is refused."""
        for _ in range(BURST + 20):
            answers.append(client.request("GET", "/v1/models", key=RATE_KEY))
            if answers[-1][0] != 200:
                return

    spend()
    status, body, headers = answers[-1]
    _error(status, body, 429, r"2 per second, 400 at once \(serve.rate_per_s, serve.burst\)", "rate_limit_exceeded")
    assert len(answers) > BURST and int(headers["Retry-After"]) >= 1
    for worse, answer in ((b"x" * (2 << 20), 413), (b'{"model": ', 400)):
        # The bucket refills a token every half second; on a busy machine one may come between the
        # refusal and this request, which is then answered for its body: spend it again and retry.
        for _ in range(5):
            answers.append(client.request("POST", "/v1/completions", worse, key=RATE_KEY))
            if (got := answers[-1][0]) != answer:
                break
            spend()
        assert got == 429
    assert client.request("GET", "/v1/models")[0] == 200
    assert client.metrics()["jaxllm_rejections_total[rate_limited]"] == refused + sum(a[0] == 429 for a in answers)


def test_unauthenticated_clients_learn_nothing_and_their_floods_are_rate_limited(served):
    """Without a valid key every path but /health and /metrics answers 401 with the same message,
    whatever else is wrong, naming no model, limit or setting; an address that keeps trying is
    answered 429 (with no limit named), while clients with a key from elsewhere go on."""
    stranger = Client(served["port"], source="127.0.0.2")  # an address of its own: its own bucket
    tries = [("GET", "/openapi.json", b""), ("GET", "/v1/models", b""), ("GET", "/v1/engines", b""),
             ("POST", "/v1/completions", b"x" * (2 << 20)), ("POST", "/v1/completions", b'{"model": '),
             ("POST", "/v1/completions", {"model": "gpt-9", "prompt": [7] * 200, "n": 99}),
             ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []})]  # fmt: skip
    answers = [stranger.request(method, path, body, key=key) for method, path, body in tries for key in (None, "no")]
    messages = {a[1]["error"]["message"] for a in answers}
    assert {a[0] for a in answers} == {401} and len(messages) == 1
    assert not re.search(r"tiny|\d|serve\.", messages.pop())
    statuses = []
    while len(statuses) < BURST + 20 and (not statuses or statuses[-1][0] == 401):
        statuses.append(stranger.request("GET", "/v1/models", key="guess"))
    status, body, headers = statuses[-1]
    _error(status, body, 429, r"^too many requests; retry in \d+ s$", "rate_limit_exceeded")
    assert len(answers) + len(statuses) > BURST and int(headers["Retry-After"]) >= 1
    assert served["client"].request("GET", "/v1/models")[0] == 200


# Each guard in the order docs/serving.md gives, with what breaks it in a body; a request that breaks several
# is answered by the first.
ORDER = ["key", "size", "json", "unsupported", "field", "model", "context", "deny"]
ANSWERS = {
    "key": (401, "invalid_api_key"), "size": (413, "request_too_large"), "json": (400, "invalid_json"),
    "unsupported": (422, "unsupported_field"), "field": (422, "invalid_value"), "model": (404, "model_not_found"),
    "context": (422, "context_length_exceeded"), "deny": (400, "content_policy_violation"),
}  # fmt: skip


def _breaking(guards: set[str]) -> tuple[bytes, str | None]:
    body = {
        "model": "gpt-9" if "model" in guards else "tiny",
        "max_tokens": 2,
        "prompt": ("forbidden word " if "deny" in guards else "") + ("word " * 300 if "context" in guards else "x"),
    }
    if "unsupported" in guards:
        body["logit_bias"] = {"5": 3}
    if "field" in guards:
        body["n"] = 99
    if "size" in guards:
        body["padding"] = "x" * (1 << 20)
    raw = json.dumps(body).encode()
    return raw[:-1] if "json" in guards else raw, None if "key" in guards else KEY


@pytest.mark.parametrize("first", ORDER[:-1])
def test_a_request_breaking_several_guards_gets_the_first(served, first):
    """`first` with each guard after it, and with all of them."""
    later = ORDER[ORDER.index(first) + 1 :]
    for guards in [{first, other} for other in later] + [{first, *later}]:
        status, body, _ = served["client"].request("POST", "/v1/completions", *_breaking(guards))
        assert (status, body["error"]["code"]) == ANSWERS[first], (guards, body)
    assert served["client"].request("POST", "/v1/completions", *_breaking({"deny"}))[0] == 400


def test_a_chunked_body_over_the_limit_is_a_413(served):
    connection = http.client.HTTPConnection("127.0.0.1", served["port"], timeout=60)
    chunks = (b"x" * 65536 for _ in range(32))  # 2 MB, with no Content-Length
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        connection.request("POST", "/v1/completions", chunks, headers, encode_chunked=True)
    except (BrokenPipeError, ConnectionResetError):  # it answered before reading the whole body
        pass
    response = connection.getresponse()
    _error(response.status, json.loads(response.read()), 413, r"over 1048576 bytes", "request_too_large")


# (field, a value at its bound, one past it, other fields): the field's guard takes the bound
# (later guards may still refuse it: the context, the alarm), and refuses one past it with a 422
# naming the field; on the completions route unless the field is the chat's.
BOUNDS = [
    ("n", SLOTS, SLOTS + 1, {}), ("top_k", 512, 513, {}), ("max_tokens", MAX_LEN - 1, MAX_LEN, {"prompt": [5]}),
    ("logprobs", 5, 6, {}), ("seed", 2**32 - 1, 2**32, {}), ("temperature", 2, 2.001, {}),
    ("top_p", 1, 1.001, {}), ("top_p", 1e-9, 0, {}), ("min_p", 1, 1.001, {}), ("min_p", 0, -0.001, {}),
    ("stop", ["a"] * 4, ["a"] * 5, {}),
    ("prompt", [511], [512], {}), ("prompt", ["x"] * SLOTS, ["x"] * (SLOTS + 1), {}),
    ("prompt", [7] * MAX_PROMPT, [7] * (MAX_PROMPT + 1), {"max_tokens": 1}),
    ("top_logprobs", 20, 21, {"logprobs": True}), ("max_completion_tokens", MAX_LEN - 1, MAX_LEN, {}),
]  # fmt: skip
CHAT_FIELDS = ("top_logprobs", "max_completion_tokens")


@pytest.mark.parametrize("field, at, past, other", BOUNDS, ids=[f"{b[0]}-{b[1]!r:.12}" for b in BOUNDS])
def test_every_field_at_its_bound_is_taken_and_one_past_it_refused(served, field, at, past, other):
    chat = field in CHAT_FIELDS
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": "tiny", "max_tokens": 1, **({"messages": [{"role": "user", "content": "x"}]} if chat else {
            "prompt": "x"})} | other  # fmt: skip
    if field == "max_completion_tokens":
        base.pop("max_tokens")
    status, body, _ = served["client"].request("POST", path, base | {field: at})
    assert status == 200 or body["error"]["code"] in ("context_length_exceeded", "perplexity_alarm"), body
    status, body, _ = served["client"].request("POST", path, base | {field: past})
    _error(status, body, 422, f"^{field}", "invalid_value")


def test_perplexity_alarm_refuses_with_a_metric_and_a_logged_request_id(served, reference):
    gibberish = np.random.default_rng(0).integers(0, 512, 60).tolist()
    nll = -reference(gibberish)[np.arange(59), gibberish[1:]]
    assert np.exp(nll.mean()) > PPL_ALARM  # the recompute agrees this prompt passes the alarm
    client = served["client"]
    counted = ("jaxllm_perplexity_alarms_total", "jaxllm_rejections_total[perplexity]")
    before = [client.metrics().get(k, 0) for k in counted]
    status, body, headers = client.complete({"prompt": gibberish, "max_tokens": 4})
    _error(status, body, 400, r"perplexity \(\d+\.\d whole.*limit of 1000 \(serve.ppl_alarm\)", "perplexity_alarm")
    assert [client.metrics()[k] for k in counted] == [n + 1 for n in before]
    assert f"perplexity alarm: request {headers['X-Request-Id']}" in served["log"].read_text()
    assert client.complete({"prompt": PROMPT, "max_tokens": 4})[0] == 200


def _send_unread(served, stream: bool, max_tokens=200):
    """A completion whose response is left unread; returns the connection."""
    connection = http.client.HTTPConnection("127.0.0.1", served["port"], timeout=60)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    return connection


def _idle(client):
    m = client.metrics()
    return m["jaxllm_active_slots"] == 0 and m["jaxllm_queue_depth"] == 0


def test_full_queue_answers_503_and_clients_that_leave_free_their_slots(served):
    """Streamed and whole requests, running or queued: when their clients close the connection,
    their slots and queue places are freed within a step or so."""
    client = served["client"]
    streams = [_send_unread(served, stream=i % 2 == 0) for i in range(SLOTS + QUEUE)]
    full = {"jaxllm_active_slots": SLOTS, "jaxllm_queue_depth": QUEUE}  # every request in, however they came
    wait_for(lambda: {k: client.metrics()[k] for k in full} == full)
    busy = client.metrics()
    assert busy["jaxllm_active_slots"] == SLOTS and 0 < busy["jaxllm_kv_cache_usage"] <= 1
    errors = _server_errors(client)
    status, body, headers = client.complete({"prompt": "x", "max_tokens": 2})
    _error(status, body, 503, rf"all {QUEUE} queue places are taken \(serve.max_queue\)", "queue_full")
    refused = busy.get("jaxllm_rejections_total[queue_full]", 0)
    assert client.metrics()["jaxllm_rejections_total[queue_full]"] == refused + 1
    assert _server_errors(client) == errors + 1  # what the flood test reads, seen to count a 5xx
    assert int(headers["Retry-After"]) >= 1
    steps = client.metrics()["jaxllm_decode_step_slots_count"]
    for connection in streams:
        connection.close()
    wait_for(lambda: _idle(client))
    # Had the requests run on, 2 x 200 tokens in 8 slots would have taken 400 steps.
    assert client.metrics()["jaxllm_decode_step_slots_count"] - steps < 100


def _answered(client) -> collections.Counter:
    """Requests the server counted, by status, over every route."""
    counted = collections.Counter()
    for key, value in client.metrics().items():
        if match := re.fullmatch(r"jaxllm_requests_total\[.*\]\[(\d+)\]", key):
            counted[int(match[1])] += value
    return counted


def _server_errors(client) -> float:
    return sum(n for status, n in _answered(client).items() if status >= 500)


def test_malformed_flood_leaves_the_server_as_it_was(served):
    """Over 200 malformed requests of every kind: each counted under its 4xx status, no 5xx, then
    healthy, idle, same greedy text."""
    client = served["client"]
    before = greedy(served["sdk"], PROMPT, 16).choices[0].text
    answered = _answered(client)
    flood = [g for g in GUARDS if g[0] != "too large"] * 8 + [g for g in GUARDS if g[0] == "too large"] * 2
    for guard in flood:  # with a key of its own: the flood is more than the main key's burst
        status = _send(served, guard, FLOOD_KEY)[0]
        assert status == guard[5], guard[0]
    assert len(flood) >= 200
    counted = _answered(client) - answered
    assert counted == collections.Counter(g[5] for g in flood) + collections.Counter({200: 1})  # and the metrics read
    assert client.request("GET", "/health", key=None)[0] == 200
    wait_for(lambda: _idle(client))
    assert greedy(served["sdk"], PROMPT, 16).choices[0].text == before


def test_a_restart_reads_every_step_from_the_compilation_cache(served, tmp_path):
    """The same server started again over the run: every step comes from WORKDIR/xla-cache, and
    /metrics exports the start-up time."""
    log = tmp_path / "server.log"
    with serve_process(["--workdir", served["workdir"]], log, *served["flags"]) as (port, statuses):
        startup = metric_values(httpx.get(f"http://127.0.0.1:{port}/metrics").text)["jaxllm_startup_seconds"]
    assert f"compilation cache {served['workdir'] / 'xla-cache'}" in log.read_text()
    _check_start_up(statuses, log.read_text(), cached=True)
    assert startup > 0


def test_a_port_in_use_is_refused_before_loading(served):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "jaxllm.serve", "--workdir", str(served["workdir"]),
                   f"--config.serve.port={port}"]  # fmt: skip
        refused = run(command, check=False)
    assert refused.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use); free the port" in refused.stderr


def test_models_and_health_through_the_openai_client(served):
    sdk = served["sdk"]
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    assert served["client"].metrics()["jaxllm_engine_up"] == 1
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError, match="not served here"):
        sdk.completions.create(model="gpt-9", prompt="x")


def test_int8_weights_and_kv_cache_answer_through_http(served, tmp_path):
    """`serve --quantize int8 --config.serve.kv_dtype=int8` on the same run: a greedy completion
    equals the int8 model's own recompute through an int8 KV cache, its log-probs to 2e-3 (the
    server writes the cache a token at a time, the recompute in one pass: their fp32 keys may
    differ in the last bit, and an int8 entry with them)."""
    workdir, tokenizer = served["workdir"], served["tokenizer"]
    cfg = stored_config(workdir)
    params = load_params(workdir, dtype=cfg.model.dtype, quantize="int8")[1]
    int8 = cfg.model.replace(quantize="int8")
    ids = tokenizer.encode(PROMPT)
    start = len(ids)

    @jax.jit
    def recompute(padded):  # one compile; causal, and each cache entry is quantized alone
        logits, _ = Model(int8).prefill(params, padded[None], KVCache.empty(int8, 1, padded.shape[0], "int8"))
        return jax.nn.log_softmax(logits[0])

    def logprobs(ids):
        return np.asarray(recompute(np.pad(np.asarray(ids, np.int32), (0, 64 - len(ids)))))[: len(ids)]

    for _ in range(12):
        ids.append(int(np.argmax(logprobs(ids)[-1])))
    want = logprobs(ids)
    flags = ["--quantize", "int8", "--config.serve.kv_dtype=int8", "--config.serve.model_name=tiny-int8",
             "--config.serve.slots=2", "--config.serve.max_len=64", "--config.serve.max_prompt_tokens=32"]  # fmt: skip
    with serve_process(["--workdir", workdir], tmp_path / "server.log", *flags) as (port, _):
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none needed", max_retries=0)
        done = sdk.completions.create(model="tiny-int8", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert "int8 weights" in (tmp_path / "server.log").read_text()
    choice = done.choices[0]
    assert choice.text == tokenizer.decode(ids[start:])
    np.testing.assert_allclose(
        choice.logprobs.token_logprobs, want[np.arange(start - 1, len(ids) - 1), ids[start:]], atol=2e-3
    )


def test_a_soak_of_mixed_clients_ends_with_no_failure_and_everything_freed(served, tmp_path):
    """scripts/soak_serve.py at a small scale (its own server on the module's run): every check
    it makes passes, and the mix reached every kind of request and answer."""
    figures_file = tmp_path / "soak.json"
    command = [sys.executable, "scripts/soak_serve.py", "--workdir", str(served["workdir"]), "--clients", "24",
               "--seconds", "30", "--json", str(figures_file)]  # fmt: skip
    done = run(command, check=False)
    figures = json.loads(figures_file.read_text())
    assert done.returncode == 0 and all(figures["checks"].values()), done.stdout
    assert figures["server 5xx"] == figures["hangs"] == 0  # how many requests fit in 30 s is the machine's
    assert len(figures["by kind"]) == 8 and {"200", "401", "422", "499"} <= set(figures["server statuses"])
