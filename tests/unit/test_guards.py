"""The server's guards and chat templates, each against a plain restatement of its rule."""

import math

import numpy as np
import pytest

from jaxllm.config import ConfigError
from jaxllm.data.chat import ChatTemplate, ChatTemplateError
from jaxllm.serve.guards import PPL_WINDOW, DenyList, RateLimiter, load_api_keys, prompt_perplexity


def test_token_bucket_spends_its_burst_then_refills_at_its_rate():
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(4)] == [0, 0, 0, 1]  # one token in half a second: wait 1 s
    assert limiter.take("b") == 0  # each key has its own bucket
    now[0] = 0.5
    assert limiter.take("a") == 0 and limiter.take("a") == 1
    now[0] = 100.0  # refills to the burst, not beyond
    assert [limiter.take("a") for _ in range(4)] == [0, 0, 0, 1]
    slow = RateLimiter(rate=0.1, burst=1, clock=lambda: now[0])
    assert slow.take("c") == 0 and slow.take("c") == 10  # whole seconds, rounded up


def test_deny_list_matches_the_normalised_casefolded_text(tmp_path):
    deny = tmp_path / "deny"
    deny.write_text("# comment\n\nsecret\\s+plan\n")
    patterns = DenyList.from_file(str(deny))
    assert patterns.match("our ＳＥＣＲＥＴ\u00a0Plan") == "secret\\s+plan"  # full-width letters, no-break space
    assert DenyList(["strasse"]).match("Straße") == "strasse"  # casefolding spells ß as ss
    assert patterns.match("a secretive planner") is None
    deny.write_text("ok\n(unclosed\n")
    with pytest.raises(ConfigError, match=r"line 2: '\(unclosed' is not a regex"):
        DenyList.from_file(str(deny))


def test_api_keys_come_from_the_file_and_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("alpha  # the first\n\n# none\nbeta\n")
    monkeypatch.setenv("JAXLLM_API_KEYS", "gamma, delta,")
    assert load_api_keys(str(keys)) == {"alpha", "beta", "gamma", "delta"}
    monkeypatch.delenv("JAXLLM_API_KEYS")
    assert load_api_keys(None) == frozenset()  # authentication off
    with pytest.raises(ConfigError, match="--api-keys .*missing: no such file"):
        load_api_keys(str(tmp_path / "missing"))


def test_prompt_perplexity_is_the_whole_and_the_worst_window():
    nll = np.random.default_rng(0).uniform(0, 3, 100)
    nll[40:50] += 6  # a burst of gibberish
    windows = [math.exp(np.mean(nll[i : i + PPL_WINDOW])) for i in range(len(nll) - PPL_WINDOW + 1)]
    whole, worst = prompt_perplexity(nll)
    np.testing.assert_allclose((whole, worst), (math.exp(np.mean(nll)), max(windows)), rtol=1e-9)
    assert worst > whole
    short = nll[:10]
    np.testing.assert_allclose(prompt_perplexity(short), [math.exp(np.mean(short))] * 2)
    assert prompt_perplexity(np.zeros(0)) == (1.0, 1.0)


def test_builtin_chat_template_is_the_documented_transcript():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate().render(messages) == "system: Be brief.\nuser: Hi\nassistant:"


def test_chat_template_file_errors(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% if m.role == 'tool' %}"
                        "{{ raise_exception('no tools') }}{% endif %}{% endfor %}")  # fmt: skip
    chat = ChatTemplate.chosen(str(template), None, {"bos_token": "<s>", "eos_token": "</s>"})
    assert chat.render([{"role": "user", "content": "x"}]) == "<s>x"
    with pytest.raises(ChatTemplateError, match="no tools"):
        chat.render([{"role": "tool", "content": "x"}])
    halving = "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content / 2 }}{% endif %}{% endfor %}"
    template.write_text(halving)  # renders a user's message, fails on an assistant's
    with pytest.raises(ChatTemplateError, match="the chat template cannot render these messages: unsupported operand"):
        ChatTemplate.chosen(str(template), None, {}).render([{"role": "assistant", "content": "x"}])
    template.write_text("{% for m in messages %}{{ m.content / 2 }}{% endfor %}")
    with pytest.raises(ConfigError, match=f"--chat-template {template} does not render a one-message chat"):
        ChatTemplate.chosen(str(template), None, {})
    template.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not render"):
        ChatTemplate.chosen(str(template), None, {})
