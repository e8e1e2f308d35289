"""Tests for jaxrl_tools.config: shipped YAMLs, overrides, clear errors, round trip."""

import dataclasses
import glob
import os

import pytest

from jaxrl_tools.config import AlgorithmSection, ConfigError, RunConfig
from jaxrl_tools.config_loader import config_from_dict, load_config, save_config
from jaxrl_tools.train import objectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
DEMO = os.path.join(ROOT, "configs", "grpo_tool_math.yaml")


def test_configs_exist():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {
        "grpo_tool_math.yaml",
        "otc_tool_math.yaml",
        "ppo_tool_math.yaml",
        "retool.yaml",
        "search_r1.yaml",
        "dapo.yaml",
        "frozenlake_grpo.yaml",
        "sokoban_gigpo.yaml",
        "sokoban_starpo.yaml",
        "refine_kevin.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_parses(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # round trip through save_config
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg


def test_defaults_and_frozen():
    cfg = load_config(None, ["tokenizer.path=/tmp/tok"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.group_size == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0  # type: ignore[misc]


def test_override_forms():
    cfg = load_config(
        DEMO,
        [
            "optim.lr=2e-6",
            "--trainer.steps",
            "7",
            "--rollout.top_p=0.9",
            "trainer.mesh=1x2x1",
            "algorithm.dual_clip_c=null",
            "reward.0.kwargs.wrong=-1.0",
            "data.train_files=[a.jsonl, b.parquet]",
            "algorithm.filters.zerotir=true",
        ],
    )
    assert cfg.optim.lr == pytest.approx(2e-6)
    assert cfg.trainer.steps == 7 and cfg.rollout.top_p == pytest.approx(0.9)
    assert cfg.trainer.mesh_shape == (1, 2, 1)
    assert cfg.algorithm.dual_clip_c is None
    assert cfg.reward[0].kwargs["wrong"] == -1.0
    assert cfg.data.train_files == ("a.jsonl", "b.parquet")
    assert cfg.algorithm.filters.zerotir
    # untouched values come from the YAML
    assert cfg.rollout.group_size == 8 and cfg.algorithm.clip_eps_high == pytest.approx(0.28)


def test_unknown_key_names_key_and_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["optim.lrr=1e-6"])
    msg = str(e.value)
    assert "optim.lrr" in msg and "did you mean 'lr'" in msg and "warmup_steps" in msg
    bad = tmp_path / "typo.yaml"
    bad.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert (
        "trainer.stepz" in str(e.value) and "'steps'" in str(e.value) and str(bad) in str(e.value)
    )
    with pytest.raises(ConfigError, match="unknown key 'modle'.*valid keys for the top level"):
        config_from_dict({"modle": {}})
    with pytest.raises(ConfigError, match=r"reward\[0\].wieght"):
        config_from_dict({"tokenizer": {"path": "t"}, "reward": [{"name": "math", "wieght": 1}]})


def test_wrong_type_names_field(tmp_path):
    with pytest.raises(ConfigError, match="trainer.steps"):
        load_config(DEMO, ["trainer.steps=many"])
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(DEMO, ["rollout.group_size=1.5"])
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(DEMO, ["trainer=5"])
    with pytest.raises(ConfigError, match="tools must be a list"):
        load_config(DEMO, ["tools=python"])


def test_the_dual_clip_is_the_policy_losss_own_unless_set():
    """PPO's clip has Ye et al.'s dual clip (c = 3); GSPO's objective has none unless asked."""

    def loss_config(*overrides):
        cfg = load_config(DEMO, ["algorithm.dual_clip_c=auto", *overrides])
        return objectives.policy_loss_config(cfg.algorithm, cfg.rollout.max_response_len)

    assert loss_config().dual_clip_c == 3.0 and loss_config().ratio_type == "token"
    gspo = loss_config("algorithm.policy_loss=gspo")
    assert gspo.dual_clip_c is None and gspo.ratio_type == "sequence"
    assert loss_config("algorithm.policy_loss=gspo", "algorithm.dual_clip_c=2.5").dual_clip_c == 2.5
    assert loss_config("algorithm.dual_clip_c=null").dual_clip_c is None
    assert AlgorithmSection().dual_clip_c == "auto"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algorithm.clip_eps_low=0", "algorithm.clip_eps_low must be > 0"),
        ("algorithm.dual_clip_c=1.0", "algorithm.dual_clip_c must be > 1"),
        (
            "algorithm.dual_clip_c=always",
            "algorithm.dual_clip_c must be a number > 1, auto or null",
        ),
        ("rollout.group_size=0", "rollout.group_size must be >= 1"),
        ("rollout.max_parked=-1", "rollout.max_parked must be >= 0 or null, got -1"),
        ("rollout.max_turn_tokens=97", "rollout.max_turn_tokens must be in [1, max_response_len"),
        ("algorithm.step_gamma=1.5", "algorithm.step_gamma must be in [0, 1], got 1.5"),
        ("rollout.protocol=openai", "rollout.protocol='openai' is not one of"),
        ("algorithm.adv_estimator=grp0", "did you mean 'grpo'"),
        ("algorithm.loss_agg_mode=mean", "algorithm.loss_agg_mode"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("trainer.mesh=2x2", "trainer.mesh"),
        ("algorithm.adv_estimator=gae", "needs a critic (critic.enabled: true)"),
        ("algorithm.adv_estimator=gigpo", "needs multi-turn environment steps (an env section"),
        ("algorithm.adv_estimator=kevin", "needs multi-turn environment steps (an env section"),
        ("rollout.protocol=ragen", "rollout.protocol='ragen' is not one of"),
        ("model.dtype=float16", "model.dtype='float16' is not one of"),
        ("tools.0.config.n_wokers=2", "did you mean 'n_workers'"),
        ("tools.0.cls=pyhton", "tools[0].cls: unknown tool class 'pyhton'"),
        ("reward.0.name=mathh", "reward[0].name"),
        ("model.tiny.num_key_value_heads=3", "model.tiny.num_attention_heads"),
        ("tokenizer.path=null", "tokenizer.path must be set"),
    ],
)
def test_validation_errors_name_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    assert needle in str(e.value)


def test_the_plain_template_is_refused_where_it_cannot_render_the_turns():
    def error(config, *overrides):
        with pytest.raises(ConfigError) as e:
            load_config(
                os.path.join(ROOT, "configs", config), ["rollout.template=plain", *overrides]
            )
        return str(e.value).split(": ", 1)[1]  # after the config's path

    assert error("grpo_tool_math.yaml", "rollout.protocol=qwen").startswith(
        "rollout.template 'plain' has no tool turns, which protocol 'qwen' answers in"
    )
    assert error("frozenlake_demo.yaml").startswith(
        "rollout.template 'plain' renders a prompt and one response; environments and agents"
    )
    assert error("grpo_tool_math.yaml", "rollout.plain_format=Question").startswith(
        "rollout.plain_format must hold {prompt} (where the question goes) once, got 'Question'"
    )
    with pytest.raises(ConfigError, match=r"rollout\.template='base' is not one of"):
        load_config(DEMO, ["rollout.template=base"])
    assert load_config(DEMO, ["rollout.template=plain"]).rollout.template == "plain"


def test_tool_class_alias_and_derived(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "tokenizer: {path: tok}\n"
        "tools:\n  - {class: python, config: {mode: stateless}}\n"
        "algorithm: {kl_coef: 0.001}\n"
    )
    cfg = load_config(path)
    assert cfg.tools[0].cls == "python" and cfg.tools[0].config == {"mode": "stateless"}
    assert cfg.use_reference_model and cfg.algorithm.kl_in_loss
    assert not cfg.algorithm.uses_critic
    ppo = load_config(os.path.join(ROOT, "configs", "ppo_tool_math.yaml"))
    assert ppo.algorithm.uses_critic and not ppo.algorithm.kl_in_loss
    assert load_config(os.path.join(ROOT, "configs", "dapo.yaml")).use_reference_model is False


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot parse override"):
        load_config(DEMO, ["optim.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_build_their_tools(path):
    """Every recipe's tools are built from its config (no worker pool, no index started)."""
    from jaxrl_tools.tools import PythonTool, SearchTool, create_tool

    for spec in load_config(path).tools:
        tool = create_tool(spec.cls, dict(spec.config))
        assert tool.schema()["function"]["name"]
        if isinstance(tool, PythonTool):
            assert tool._pool is None
        if isinstance(tool, SearchTool):
            assert tool._index is None


def test_kl_in_reward_needs_an_estimator_with_token_rewards():
    with pytest.raises(ConfigError, match="has no token rewards to fold the KL into"):
        load_config(DEMO, ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.01"])
    cfg = load_config(
        DEMO,
        [
            "algorithm.kl_in_reward=true",
            "algorithm.kl_coef=0.01",
            "algorithm.adv_estimator=reinforce_pp",
        ],
    )
    assert cfg.algorithm.kl_coef == 0.01


def test_starpo_updates_once_per_rollout_on_the_kept_groups_as_ragen():
    """RAGEN's StarPO-S runs are "Online-1": the groups its variance filter keeps (25% of 8 x
    16 = 32 trajectories) are one update of its ppo_mini_batch_size 32, each update on fresh
    rollouts. Rows past the kept ones are padding: 4 mini-batches would be 4 updates of ~8."""
    cfg = load_config(os.path.join(ROOT, "configs", "sokoban_starpo.yaml"))
    f, o = cfg.algorithm.filters, cfg.optim
    assert f.starpo_s
    kept_rows = int(f.starpo_keep_frac * cfg.data.batch_size) * cfg.rollout.group_size
    assert kept_rows == 32
    assert o.ppo_epochs * o.num_mini_batches == 1
    assert kept_rows % o.micro_batch_size == 0


def test_artist_format_reward_reads_the_tags_the_rollout_writes():
    """ARTIST's format reward with other tags than the rollout's scores 0 on every response:
    caught at load, naming the reward's kwarg."""
    from jaxrl_tools import configs

    artist = load_config(configs.resolve("artist"))  # named tags, the reward told so
    assert artist.rollout.tool_tags == "named"
    i = next(i for i, r in enumerate(artist.reward) if r.name == "artist_format")
    kwargs = {k: v for k, v in artist.reward[i].kwargs.items() if k != "tool_tags"}
    terms = [dataclasses.asdict(r) for r in artist.reward]
    terms[i]["kwargs"] = kwargs
    with pytest.raises(ConfigError, match=rf"reward\[{i}\]\.kwargs\.tool_tags.*\['python'\]"):
        load_config(configs.resolve("artist"), [f"reward={terms}"])
    load_config(configs.resolve("artist"), [f"reward={terms}", "rollout.tool_tags=tool"])
