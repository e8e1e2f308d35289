"""Shared fixtures: tiny random Hugging Face models saved into temporary folders."""

import os
import shutil
import tempfile

import pytest

# One XLA compilation cache for the run, inherited by the subprocess tests (resume, CLI, the
# 8-device sharding runs), which compile the same programs again in each process.
# Every compile, not only those over a second: the subprocess tests repeat many small ones.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
else:
    _XLA_CACHE = None

# The longest files first (measured): `--dist loadfile` runs each file whole on one worker, and
# handing the long ones out first keeps one of them from starting last (CI time). xdist keeps
# this order only with --no-loadscope-reorder (scripts/test.sh); by default it sorts the files by
# their number of tests.
LONGEST_FIRST = (
    "test_multihost.py",
    "test_check.py",
    "test_train_rl_sharding.py",
    "test_multiturn.py",
    "test_share_prefix.py",
    "test_rollout_loop.py",
    "test_targets.py",
    "test_lora.py",
    "test_models.py",
    "test_plan.py",
    "test_models_attention_pallas.py",
    "test_smollm2.py",
    "test_train_rl.py",
    "test_grid_demos.py",
    "test_packing.py",
    "test_agents.py",
    "test_resume.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def _perturb(model, seed: int) -> None:
    """Makes norms and biases non-trivial (transformers initialises them to 1 and 0)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Factory: tiny_hf("qwen2"|"qwen3"|"llama", **config_overrides) -> (torch model, folder).

    The model is float32, eager attention, eval mode, with random weights; cached per arguments.
    """
    import torch
    import transformers

    classes = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "llama": transformers.LlamaConfig,
    }
    made = {}

    def make(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items(), key=lambda kv: kv[0])).__repr__())
        if key not in made:
            kwargs = dict(TINY)
            if family == "qwen3":
                kwargs["head_dim"] = 16
            kwargs.update(overrides)
            config = classes[family](**kwargs)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="eager", dtype=torch.float32
            ).eval()
            _perturb(model, seed=len(made))
            folder = tmp_path_factory.mktemp(f"hf_{family}")
            model.save_pretrained(folder)
            made[key] = (model, folder)
        return made[key]

    return make


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny tool-arithmetic tokenizer (512 tokens); a file may define its own `tok`."""
    from jaxrl_tools.tasks.tokenizer import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=512)


@pytest.fixture(scope="module")
def tok_model(tok):
    """(config, params) of the tiny Qwen2 (`fakes.tiny_model_config`, no attention bias) on
    `tok`'s vocabulary, random weights of key 0."""
    import jax
    from fakes import tiny_model_config

    from jaxrl_tools import models

    config = tiny_model_config(vocab_size=len(tok), attention_bias=False)
    return config, models.init_params(config, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def tiny():
    """(config, params) of `fakes.tiny_model_config()`, random weights of key 0."""
    import jax
    from fakes import tiny_model_config

    from jaxrl_tools import models

    config = tiny_model_config()
    return config, models.init_params(config, jax.random.key(0))
