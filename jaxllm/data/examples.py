"""Training examples for fine-tuning → token ids and a loss mask (1 on the tokens the model learns).

- `chat`: a record's `messages` (and optional `tools`), rendered by the chat template serving uses,
  tokenized once with special tokens parsed (as a server tokenizes the prompt); the mask is 1 on the
  tokens that overlap an assistant turn's text, its end-of-turn included.
- `prompt_completion`: the tokenizer's prompt prefix + prompt, then completion + end-of-text; the
  mask is 1 on the completion and the end-of-text. Prompt and completion are tokenized apart, as a
  server sees the prompt.
"""

from __future__ import annotations

import numpy as np

from jaxllm.data.chat import ChatTemplate, ChatTemplateError
from jaxllm.data.corpus import CorpusError
from jaxllm.data.tokenizer import Tokenizer

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
FIELDS = {"chat": ["messages"], "prompt_completion": ["prompt", "completion"]}
OPTIONAL = {"chat": ("tools",), "prompt_completion": ()}


def check_chat(key: str, record: dict) -> tuple[list[dict], list | None]:
    """The record's messages and tools, or an error naming the line and the field."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise CorpusError(f"{key}: messages must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise CorpusError(f"{key}: messages[{i}] must be an object with a role and a content")
        if message.get("role") not in ROLES:
            raise CorpusError(f"{key}: messages[{i}].role must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise CorpusError(f"{key}: messages[{i}].content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise CorpusError(f"{key}: messages has no assistant message, so nothing to learn; add one or leave it out")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise CorpusError(f"{key}: tools must be a list of tool definitions")
    return messages, tools


def overlaps(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose [start, end) characters overlap one of the spans."""
    bounds = np.asarray(offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(bounds), np.uint8)
    for start, end in spans:
        mask |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return mask


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate, key: str, record: dict) -> tuple[list[int], np.ndarray]:
    """A conversation's ids (no prompt prefix, no end-of-text after it: the template places
    those) and its mask."""
    messages, tools = check_chat(key, record)
    try:
        text, spans = template.assistant_spans(messages, tools)
    except ChatTemplateError as e:
        raise CorpusError(f"{key}: {e}") from e
    ids, offsets = tokenizer.encode_with_offsets(text)
    return ids, overlaps(offsets, spans)


def encode_prompt_completions(
    tokenizer: Tokenizer, records: list[tuple[str, dict]]
) -> list[tuple[list[int], np.ndarray]]:
    """The ids and masks of prompt/completion records, tokenized in two batches."""
    for key, record in records:
        for field in ("prompt", "completion"):
            if not isinstance(record.get(field), str):
                raise CorpusError(f"{key}: {field} must be a string")
    prompts = tokenizer.encode_batch([r["prompt"] for _, r in records])
    completions = tokenizer.encode_batch([r["completion"] for _, r in records])
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        first, learned = [*tokenizer.prompt_prefix, *prompt], [*completion, tokenizer.eos_id]
        mask = np.concatenate([np.zeros(len(first), np.uint8), np.ones(len(learned), np.uint8)])
        out.append((first + learned, mask))
    return out
