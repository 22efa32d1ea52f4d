"""Config validation: each bad setting is refused with a message naming the field and the fix."""

import dataclasses

import pytest
from support.runs import ROOT, small_config

from jaxllm import reference
from jaxllm.config import ConfigError, RunConfig, Section, apply_overrides, base_config, load_config, validate
from jaxllm.serve.settings import ServeConfig, serving_config

CASES = {
    "layers vs qkv sharing": (
        {"model.num_layers": 6, "model.qkv_share_every": 4},
        ["model.num_layers=6", "multiple of 4"],
    ),
    "heads vs tensor": (
        {"model.num_heads": 6, "model.num_kv_heads": 6, "model.head_dim": 8, "parallel.tensor": 4, "parallel.data": 2},
        ["model.num_heads=6", "parallel.tensor=4"],
    ),
    "kv heads vs tensor": (
        {"model.num_kv_heads": 2, "parallel.tensor": 4, "parallel.data": 2},
        ["model.num_kv_heads=2", "parallel.tensor=4"],
    ),
    "mlp vs tensor": (
        {"model.mlp": 100, "model.num_kv_heads": 8, "parallel.tensor": 8, "parallel.data": 1},
        ["model.mlp=100", "parallel.tensor=8"],
    ),
    "padded vocab vs tensor": (
        {
            "model.vocab_pad_multiple": 4,
            "model.vocab_size": 258,
            "model.num_kv_heads": 8,
            "parallel.tensor": 8,
            "parallel.data": 1,
        },
        ["padded vocab", "260"],
    ),
    "batch vs data": ({"train.batch_size": 12, "parallel.data": 8}, ["train.batch_size=12", "multiple of 8"]),
    "batch vs accumulation": (
        {"train.batch_size": 16, "parallel.data": 8, "train.grad_accum_steps": 4},
        ["train.batch_size=16", "8*1*4*1=32"],
    ),
    "seq_len": ({"train.seq_len": 128}, ["train.seq_len=128", "model.max_seq_len=64"]),
    "mesh product": ({"parallel.data": 2, "parallel.tensor": 2}, ["4 devices but 8 exist"]),
    "mesh does not divide": ({"parallel.data": -1, "parallel.tensor": 3}, ["does not divide the 8 devices"]),
    "two -1 sizes": ({"parallel.data": -1, "parallel.fsdp": -1}, ["at most one mesh size may be -1"]),
    "remat": ({"model.remat": "everything"}, ["model.remat='everything'", "'selective'"]),
    "norm": ({"model.norm": "batchnorm"}, ["model.norm='batchnorm'", "rmsnorm"]),
    "activation": ({"model.mlp_activation": "relu"}, ["model.mlp_activation='relu'", "swiglu"]),
    "microbatches < stages": (
        {"parallel.stage": 2, "parallel.data": 4, "parallel.microbatches": 1},
        ["parallel.microbatches=1 < parallel.stage=2", "microbatches >= 2"],
    ),
    "groups vs stages": (
        {"parallel.stage": 4, "parallel.data": 2, "parallel.microbatches": 4, "parallel.repeats": 2,
         "parallel.schedule": "circular"},
        ["gives 2 QKV groups", "parallel.stage=4 × parallel.repeats=2", "multiple of 16"],
    ),
    "stages that work": (
        {"model.num_layers": 20, "parallel.stage": 4, "parallel.data": 2, "parallel.microbatches": 4},
        ["gives 10 QKV groups", "use stage in [2, 5, 10]"],
    ),
    "sequence vs stages": (
        {"parallel.stage": 2, "parallel.data": 4, "parallel.microbatches": 2, "train.seq_len": 15},
        ["train.seq_len=15 is not divisible by parallel.stage=2", "multiple of 2"],
    ),
    "sequence vs tensor with sequence parallelism": (
        {"parallel.tensor": 4, "parallel.data": 2, "parallel.sequence_parallel": True, "train.seq_len": 18},
        ["train.seq_len=18 is not divisible by parallel.tensor×stage=4×1", "multiple of 4"],
    ),
    "batch vs microbatches": (
        {"parallel.stage": 2, "parallel.data": 4, "parallel.microbatches": 8},
        ["train.batch_size=16", "4*1*1*8=32"],
    ),
    "stage -1": ({"parallel.stage": -1, "parallel.data": 1}, ["parallel.stage=-1", "set it explicitly"]),
    "log_every": ({"train.log_every": 0}, ["train.log_every=0 must be at least 1"]),
    "empty prompt": ({"train.sample_prompt": ""}, ["train.sample_prompt is empty"]),
    "repeats without pipeline": ({"parallel.repeats": 2}, ["parallel.repeats=2 needs a pipeline"]),
    "chunks under gpipe": (
        {"parallel.stage": 2, "parallel.data": 4, "parallel.microbatches": 2, "parallel.repeats": 2},
        ["parallel.repeats=2 with parallel.schedule=gpipe", "schedule=circular or interleaved_1f1b"],
    ),
    "circular without chunks": (
        {"parallel.stage": 2, "parallel.data": 4, "parallel.microbatches": 2, "parallel.schedule": "circular"},
        ["parallel.schedule=circular passes over the stages", "repeats >= 2", "schedule=gpipe"],
    ),
    "interleaved groups of stages": (
        {"parallel.stage": 4, "parallel.data": 2, "parallel.microbatches": 6, "parallel.repeats": 2,
         "parallel.schedule": "interleaved_1f1b", "model.num_layers": 16},
        ["groups of parallel.stage=4", "parallel.microbatches=6 to a multiple of it"],
    ),
    "schedule name": ({"parallel.schedule": "zb"}, ["parallel.schedule='zb'", "'1f1b'"]),
    "padded vocab vs stage and tensor": (
        {"parallel.stage": 4, "parallel.tensor": 2, "parallel.data": 1, "parallel.microbatches": 4,
         "parallel.schedule": "1f1b", "model.vocab_pad_multiple": 4, "model.vocab_size": 258, "model.num_layers": 8},
        ["padded vocab 260", "parallel.stage×tensor=4×2", "model.vocab_pad_multiple to a multiple of 8"],
    ),
    "gqa ratio": ({"model.num_kv_heads": 3}, ["model.num_heads=8", "model.num_kv_heads=3"]),
    "checkpoints kept": ({"checkpoint.keep": 0}, ["checkpoint.keep=0 must be at least 1"]),
    "checkpoint cadence": ({"checkpoint.every_steps": -5}, ["checkpoint.every_steps=-5 must be at least 0"]),
    "attention": ({"model.attention": "flash"}, ["model.attention='flash' is unknown", "'cudnn'"]),
    "cudnn in fp32": ({"model.attention": "cudnn"}, ["model.attention='cudnn' has no float32 kernel", "bfloat16"]),
    "cudnn head dim": (
        {"model.attention": "cudnn", "model.dtype": "bfloat16", "model.head_dim": 160},
        ["multiple of 8 and at most 128, got 160", "model.attention='xla'"],
    ),
    "pallas without GQA": (
        {"model.attention": "pallas"},
        ["'pallas' has no grouped-query attention", "model.num_kv_heads=4", "'cudnn'"],
    ),
    "pallas blocks": (
        {"model.attention": "pallas", "model.num_kv_heads": 8},
        ["train.seq_len=16 is not a multiple of 128", "model.attention='xla'"],
    ),
    "fp8 head dim": ({"model.fp8.enabled": True}, ["head dim=8 is not a multiple of 16", "model.fp8.enabled=False"]),
    "fp8 mlp": (
        {"model.fp8.enabled": True, "model.num_heads": 4, "model.num_kv_heads": 4, "model.mlp": 120},
        ["model.mlp=120 is not a multiple of 16", "FP8 GEMMs"],
    ),
    "fp8 amax reduction": ({"model.fp8.amax_reduce": "stage"}, ["model.fp8.amax_reduce='stage' is unknown", "'local'"]),
    "training int8 weights": (
        {"model.quantize": "int8"},
        ["model.quantize='int8' holds int8 weights, which do not train", "model.lora.rank > 0",
         "serve with --quantize int8"],
    ),  # fmt: skip
    "lora dropout of 1": ({"model.lora.dropout": 1.0}, ["model.lora.dropout=1.0 must be", "below 1"]),
    "lora dropout NaN": ({"model.lora.dropout": float("nan")}, ["model.lora.dropout=nan must be at least 0"]),
    "trained BPE vs vocab": (
        {"data.bpe_vocab_size": 1024},
        ["data.bpe_vocab_size=1024 exceeds model.vocab_size=257", "set model.vocab_size=1024"],
    ),
}


@pytest.mark.parametrize("overrides,phrases", CASES.values(), ids=CASES.keys())
def test_bad_config_is_refused_with_field_and_fix(overrides, phrases):
    """Refused when the typed config is built, or, for what depends on the devices, by `validate`."""
    with pytest.raises(ConfigError) as err:
        validate(small_config().overridden({"parallel.data": 8, **overrides}), num_devices=8)
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))


def test_valid_configs_resolve_their_mesh():
    assert validate(small_config().overridden({"parallel.data": -1, "parallel.tensor": 2}), 8) == (4, 1, 1, 2)
    assert load_config("configs/tiny.py").parallel.mesh_shape(1) == (1, 1, 1, 1)
    for name in ("1b", "8b"):
        validate(load_config(f"configs/{name}.py"), 8)


def test_the_defaults_alone_are_a_valid_config():
    validate(RunConfig(), 1)
    assert RunConfig.from_dict(base_config()) == RunConfig()  # what users write starts from the same defaults


def test_120b_layout_is_valid_on_64_devices():
    assert validate(load_config("configs/120b.py"), 64) == (1, 8, 1, 8)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.py")


def test_a_config_is_frozen_hashable_and_round_trips_through_its_dict():
    cfg = small_config().overridden(
        {"parallel.stage": 2, "parallel.microbatches": 2, "model.rope_scaling.type": "linear"}
    )
    assert RunConfig.from_dict(cfg.to_dict()) == cfg and hash(RunConfig.from_dict(cfg.to_dict())) == hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden = 3
    assert (cfg.model.head_dim, cfg.model.num_kv_heads, cfg.model.groups, cfg.model.padded_vocab) == (8, 4, 2, 384)
    assert cfg.parallel.pipeline.bubble == 1 / 3


SERVE_CASES = {
    "no slots": ({"serve.slots": 0}, ["serve.slots=0 must be at least 1"]),
    "longer than the model": ({"serve.max_len": 65}, ["serve.max_len=65", "model.max_seq_len=64"]),
    "unknown dtype": ({"serve.dtype": "int4"}, ["serve.dtype='int4' is unknown"]),
    "int8 is no compute dtype": ({"serve.dtype": "int8"}, ["serve.dtype='int8' is unknown"]),
    "unknown kv dtype": ({"serve.kv_dtype": "int4"}, ["serve.kv_dtype='int4' is unknown", "'int8'"]),
    "unknown quantization": ({"model.quantize": "int4"}, ["model.quantize='int4' is unknown", "'int8'"]),
    "more devices than here": ({"serve.tensor": 16}, ["serve.tensor=16: this host has 8 devices"]),
    "kv heads vs tensor": ({"serve.tensor": 8}, ["model.num_kv_heads=4 is not divisible by serve.tensor=8"]),
    "no port": ({"serve.port": 0}, ["serve.port=0 must be in 1..65535"]),
    "no rate": ({"serve.rate_per_s": 0.0}, ["serve.rate_per_s=0.0 must be above 0"]),
    "no burst": ({"serve.burst": 0}, ["serve.burst=0 must be at least 1"]),
    "negative queue": ({"serve.max_queue": -1}, ["serve.max_queue=-1 must be at least 0"]),
    "tiny body": ({"serve.max_body_bytes": 0}, ["serve.max_body_bytes=0 must be at least 1"]),
    "alarm below 1": ({"serve.ppl_alarm": 0.5}, ["serve.ppl_alarm=0.5 must be above 1", "None to turn"]),
    "reject without alarm": ({"serve.ppl_reject": True}, ["serve.ppl_reject needs serve.ppl_alarm"]),
}


def _serving(overrides: dict):
    serve = {k[len("serve.") :]: v for k, v in overrides.items() if k.startswith("serve.")}
    run = small_config().overridden({k: v for k, v in overrides.items() if not k.startswith("serve.")})
    return serving_config(run, ServeConfig.from_dict(serve), local_devices=8)


@pytest.mark.parametrize("overrides,phrases", SERVE_CASES.values(), ids=SERVE_CASES.keys())
def test_bad_serving_config_is_refused_with_field_and_fix(overrides, phrases):
    with pytest.raises(ConfigError) as err:
        _serving(overrides)
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))


def test_serving_config_resolves_its_defaults():
    trained = {"model.attention": "cudnn", "model.remat": "full", "parallel.stage": 2, "parallel.microbatches": 2,
               "model.fp8.enabled": True, "model.head_dim": 16}  # fmt: skip
    served = _serving(trained)  # 4 kv heads: 4 of the 8 devices split them
    s, m = served.settings, served.model
    assert (s.max_len, s.dtype, s.kv_dtype, s.tensor) == (64, "float32", "float32", 4)
    assert (m.attention, m.remat, m.fp8.enabled) == ("xla", "none", False)
    assert served.parallel.mesh_shape(4) == (1, 1, 1, 4)
    assert not s.prompt_nll
    assert _serving({"serve.ppl_alarm": 500.0}).settings.prompt_nll  # the alarm reads the prompt's log-probs


def test_unknown_override_is_refused():
    near = r"the config has no such field; did you mean {}\?"
    with pytest.raises(ConfigError, match="--config.serve.slot: " + near.format("--config.serve.slots")):
        apply_overrides(base_config(ServeConfig), {"serve.slot": 4})
    with pytest.raises(ConfigError, match="--config.srve.slots: " + near.format("--config.serve.slots")):
        apply_overrides(base_config(ServeConfig), {"srve.slots": 4})
    with pytest.raises(ConfigError, match="--config.serve.slots.x: the config has no such field; see"):
        apply_overrides(base_config(ServeConfig), {"serve.slots.x": 4})
    with pytest.raises(ConfigError, match="serve.slot: " + near.format("serve.slots")):
        ServeConfig.from_dict({"slot": 4})


def test_docs_configuration_page_is_what_the_reference_prints_today():
    """Every field of every section, nested ones and the server's included, has a row."""

    def leaves(section: Section, prefix: str):
        for f in dataclasses.fields(section):
            value, name = getattr(section, f.name), f"{prefix}.{f.name}".lstrip(".")
            yield from leaves(value, name) if isinstance(value, Section) else [name]

    text = reference.page()
    names = [*leaves(RunConfig(), ""), *leaves(ServeConfig(), "serve")]
    assert "model.rope_scaling.factor" in names and "model.fp8.enabled" in names and "serve.slots" in names
    assert not [name for name in names if f"| `{name}` |" not in text], "every field has a row"
    assert (ROOT / "docs" / "configuration.md").read_text() == text, (
        "run: python -m jaxllm.reference > docs/configuration.md"
    )
