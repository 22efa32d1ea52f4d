"""What a server is set to (`ServeConfig`, the `serve` section of `--config.serve.x=v`), and a
model made ready to serve with it (`serving_config`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import ml_dtypes  # noqa: F401  (numpy learns bfloat16)
import numpy as np

from jaxllm.config import ModelConfig, ParallelConfig, RunConfig, Section, field, require, validate_tensor

ServeDtype = Literal["float32", "bfloat16", "float16"]
KvDtype = Literal["float32", "bfloat16", "float16", "int8"]
DEFAULT_MAX_LEN = 8192  # a slot's length unless set: a 128k-context model would give each slot gigabytes
NGRAM_LONGEST = 16  # prompt lookup compares the context once for each length up to this in every step
# The longest back-off of a speculating sequence after misses, in tokens issued
# (`speculation.spaced_out`): a draft model reads the plain steps' tokens back in one step when
# the sequence drafts again (`steps.decode`), never in the plain steps between.
LONGEST_BACK_OFF = 32


@dataclasses.dataclass(frozen=True)
class ServeConfig(Section):
    """What a server is set to: its slots and paged KV cache, the serving dtype and mesh, where it
    listens, and its guards (rate limits, body limits, the queue, deadlines, the perplexity alarm)."""

    name: ClassVar[str] = "serve"
    slots: int = field(8, "requests decoded together, one KV-cache slot each")
    max_len: int | None = field(None, f"tokens a slot holds, prompt and output (None: model.max_seq_len, at most "
                                      f"{DEFAULT_MAX_LEN})")  # fmt: skip
    max_prompt_tokens: int = field(8192, "the longest prompt (also capped at max_len - 1)")
    dtype: ServeDtype | None = field(None, "params and activations (None: model.dtype)")
    kv_dtype: KvDtype | None = field(None, "the KV cache: a float dtype, or 'int8' with per-token scales (None: dtype)")
    page_size: int = field(16, "tokens a KV-cache page holds")
    kv_pages: int | None = field(None, "pages in the KV cache's pool, page 0 kept as scratch (None: from kv_memory_gb, "
                                       "else room for every slot at max_len)")  # fmt: skip
    kv_memory_gb: float | None = field(None, "the KV cache's pool size in GB per device, if kv_pages is None")
    prefill_chunk: int = field(512, "prompt tokens prefilled per step, over one or several prompts; longer ones in "
                                    "chunks between decode steps")  # fmt: skip
    prefix_cache: bool = field(True, "share the full pages of prompts that start alike instead of prefilling them")
    attention: Literal["xla", "pallas"] | None = field(
        None, "decode attention over the pages: 'pallas' (JAX's paged kernel, GPUs) or 'xla' (None: pallas on GPUs)"
    )
    speculative: Literal["off", "ngram", "draft"] = field(
        "off", "speculative decoding: 'ngram' proposes the tokens that followed the context's last few tokens where "
        "they occurred before (prompt lookup), 'draft' those serve.draft_model continues with; verified in one "
        "step, outputs are distributed as without it"
    )  # fmt: skip
    draft_model: str | None = field(None, "the draft model of serve.speculative=draft: a run, an export or a Hugging "
                                          "Face Llama directory with the served model's tokenizer")  # fmt: skip
    draft_tokens: int = field(8, "tokens proposed a step with serve.speculative (fewer than serve.max_len)")
    speculative_max_batch: int = field(0, "prompt lookup only while at most this many sequences decode (0: at any "
                                          "number), like vLLM's disable_by_batch_size: a verify step feeds each row "
                                          "of its batch the drafts' width, which a compute-bound device (a CPU) pays "
                                          "for row by row")  # fmt: skip
    speculative_auto: bool = field(True, "verify drafts only where the steps' measured times and the drafts "
                                         "accepted so far say a verify step yields more tokens a second than a "
                                         "plain step would")  # fmt: skip
    ngram_max: int = field(4, f"the longest run of last tokens 'ngram' looks up (at most {NGRAM_LONGEST})")
    ngram_min: int = field(2, "and the shortest: shorter runs recur by chance and propose tokens that are rejected")
    tensor: int = field(-1, "devices for tensor parallelism (-1: as many local ones as split the heads evenly)")
    compile_cache: str | None = field(None, "JAX's persistent compilation cache, so a restart loads its steps instead "
                                            "of compiling them (None: $JAX_COMPILATION_CACHE_DIR, else "
                                            "WORKDIR/xla-cache for a run, else ~/.cache/jaxllm/xla-cache; "
                                            "'off': none)")  # fmt: skip
    prompt_nll: bool = field(False, "each prompt token's log-prob (the LM head over every prompt token)")
    host: str = field("127.0.0.1", "where the HTTP server listens")
    port: int = field(8000, "and on which port")
    model_name: str | None = field(None, "the id clients ask for (None: the run's or export's directory name)")
    max_body_bytes: int = field(1 << 20, "larger request bodies: 413")
    rate_per_s: float = field(10.0, "each API key's (or, without keys, client address's) request rate")
    burst: int = field(40, "and the burst it may spend at once; beyond: 429")
    max_queue: int = field(64, "requests waiting for a slot; beyond: 503")
    request_timeout_s: float = field(600.0, "a request still unfinished this long after it arrived ends with an error")
    body_timeout_s: float = field(30.0, "a request body still arriving after this long: 408")
    max_engine_restarts: int = field(3, "failed decode steps in a row the engine recovers from; one more stops it")
    ppl_alarm: float | None = field(None, "prompt perplexity (whole, or any 32-token window) to flag; None: off")
    ppl_reject: bool = field(False, "refuse flagged prompts (400) instead of only counting and logging them")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.slots >= 1, f"serve.slots={self.slots} must be at least 1")
        require(self.page_size >= 1, f"serve.page_size={self.page_size} must be at least 1")
        require(self.prefill_chunk >= 1, f"serve.prefill_chunk={self.prefill_chunk} must be at least 1")
        require(self.kv_pages is None or self.kv_pages >= 2, f"serve.kv_pages={self.kv_pages} must be at least 2")
        memory = self.kv_memory_gb
        require(memory is None or memory > 0, f"serve.kv_memory_gb={memory} must be above 0")
        require(
            self.kv_pages is None or self.kv_memory_gb is None,
            "set one of serve.kv_pages and serve.kv_memory_gb: both size the KV cache's pool",
        )
        require(self.max_prompt_tokens >= 1, f"serve.max_prompt_tokens={self.max_prompt_tokens} must be at least 1")
        require(0 < self.port < 65536, f"serve.port={self.port} must be in 1..65535")
        require(self.max_body_bytes >= 1, f"serve.max_body_bytes={self.max_body_bytes} must be at least 1")
        require(self.rate_per_s > 0, f"serve.rate_per_s={self.rate_per_s} must be above 0 (requests a second a key)")
        require(self.burst >= 1, f"serve.burst={self.burst} must be at least 1")
        require(self.max_queue >= 0, f"serve.max_queue={self.max_queue} must be at least 0")
        for name in ("request_timeout_s", "body_timeout_s"):
            require(getattr(self, name) > 0, f"serve.{name}={getattr(self, name)} must be above 0 (seconds)")
        require(self.draft_tokens >= 1, f"serve.draft_tokens={self.draft_tokens} must be at least 1")
        limit = self.speculative_max_batch
        require(limit >= 0, f"serve.speculative_max_batch={limit} must be at least 0 (0: speculate at any batch)")
        require(
            not limit or self.speculative != "draft",
            f"serve.speculative_max_batch={limit} holds prompt lookup back, not a draft model: a draft reads the "
            f"tokens decoded without it back only up to its longest back-off ({LONGEST_BACK_OFF} tokens), where a "
            "busy batch could hold it back for longer; leave it 0 with serve.speculative=draft",
        )
        require(
            (self.speculative == "draft") == bool(self.draft_model),
            f"serve.speculative={self.speculative!r} with serve.draft_model={self.draft_model!r}: a draft model is "
            "what serve.speculative=draft proposes with; set both, or neither",
        )
        require(
            1 <= self.ngram_min <= self.ngram_max <= NGRAM_LONGEST,
            f"serve.ngram_min={self.ngram_min} and serve.ngram_max={self.ngram_max} must satisfy 1 <= min <= max "
            f"<= {NGRAM_LONGEST} (each verify step compares its context once for each length up to max)",
        )
        restarts = self.max_engine_restarts
        require(restarts >= 0, f"serve.max_engine_restarts={restarts} must be at least 0")
        require(
            self.ppl_alarm is None or self.ppl_alarm > 1,
            f"serve.ppl_alarm={self.ppl_alarm} must be above 1 (a perplexity), or None to turn the alarm off",
        )
        require(
            not self.ppl_reject or self.ppl_alarm is not None, "serve.ppl_reject needs serve.ppl_alarm, the threshold"
        )


@dataclasses.dataclass(frozen=True)
class Serving:
    """What an engine serves: the model as it computes there, and the settings, every one resolved."""

    model: ModelConfig
    settings: ServeConfig
    draft: ModelConfig | None = None  # serve.draft_model's, as it computes here

    @property
    def parallel(self) -> ParallelConfig:
        """The serving mesh: a `tensor` axis over local devices (no pipeline: the KV cache needs the plain stack)."""
        return ParallelConfig(data=1, tensor=self.settings.tensor)


def serving_config(
    cfg: RunConfig, settings: ServeConfig, local_devices: int, backend: str = "cpu", draft: ModelConfig | None = None
) -> Serving:
    """A checkpoint's config made ready to serve with `settings`: each setting left None resolved,
    the model set to compute in the serving dtype with plain XLA attention, no remat and no FP8 (a
    per-tensor scale over a batch of slots would make each request's output depend on the others').
    A `draft` model (serve.draft_model's) has its say in the tensor-parallel size."""
    m, s = cfg.model, settings
    tensor = s.tensor
    if tensor == -1:  # the most local devices that split every tensor-parallel dimension evenly
        split = [d for x in (m, draft) if x for d in (x.num_heads, x.num_kv_heads, x.mlp, x.padded_vocab)]
        tensor = max(n for n in range(1, local_devices + 1) if all(dim % n == 0 for dim in split))
    dtype = s.dtype or m.dtype
    s = s.replace(
        max_len=s.max_len or min(m.max_seq_len, DEFAULT_MAX_LEN), dtype=dtype, kv_dtype=s.kv_dtype or dtype,
        tensor=tensor, prompt_nll=s.prompt_nll or s.ppl_alarm is not None,  # the alarm reads the prompt's log-probs
    )  # fmt: skip
    require(
        2 <= s.max_len <= m.max_seq_len,
        f"serve.max_len={s.max_len} must be between 2 and model.max_seq_len={m.max_seq_len} (the longest "
        "context the model was built for); lower serve.max_len or raise model.max_seq_len",
    )
    require(
        s.speculative == "off" or s.draft_tokens < s.max_len,
        f"serve.draft_tokens={s.draft_tokens} with serve.max_len={s.max_len}: a verify step feeds a token and its "
        "drafts, which must fit in a slot; propose fewer (4 to 8 is typical)",
    )
    require(
        1 <= s.tensor <= local_devices,
        f"serve.tensor={s.tensor}: this host has {local_devices} devices; use 1 to {local_devices} (-1: all)",
    )
    validate_tensor(m, s.tensor, "serve.tensor")
    s = s.replace(kv_pages=_kv_pages(m, s), attention=s.attention or ("pallas" if backend == "gpu" else "xla"))
    require(
        s.attention == "xla" or backend == "gpu",
        f"serve.attention=pallas runs JAX's paged-attention kernel, which needs a GPU; this host's backend is "
        f"{backend}: use serve.attention=xla",
    )
    return Serving(served_model(m, s), s)


def served_model(model: ModelConfig, settings: ServeConfig) -> ModelConfig:
    """`model` as a server computes it: in the serving dtype, plain XLA attention (the decode
    kernel is the cache's), no remat, no FP8."""
    return model.replace(dtype=settings.dtype, attention="xla", remat="none", fp8=model.fp8.replace(enabled=False))


def _kv_pages(model: ModelConfig, s: ServeConfig) -> int:
    """The pool's pages: as set, from the memory budget, or enough for every slot at max_len; at
    least enough for one request of max_len."""
    pages_per_slot = -(-s.max_len // s.page_size)
    pages = s.kv_pages
    if pages is None and s.kv_memory_gb is not None:
        per_head = model.head_dim * (1 if s.kv_dtype == "int8" else np.dtype(s.kv_dtype).itemsize)
        per_head += 4 if s.kv_dtype == "int8" else 0  # its fp32 scale
        page = 2 * model.num_layers * model.num_kv_heads // s.tensor * s.page_size * per_head  # keys and values
        pages = int(s.kv_memory_gb * 1e9 // page)
    pages = pages or s.slots * pages_per_slot + 1
    require(
        pages >= pages_per_slot + 1,
        f"the KV cache's pool of {pages} pages of {s.page_size} tokens (serve.kv_pages, serve.kv_memory_gb; one page "
        f"is scratch) cannot hold one request of serve.max_len={s.max_len} tokens: give it at least "
        f"{pages_per_slot + 1} pages, or lower serve.max_len",
    )
    return pages
