"""`RunConfig`, the whole run: its sections and the checks that span several of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxrl_tools import algorithms, rewards
from jaxrl_tools.config.checks import ConfigError, _check, _check_choice
from jaxrl_tools.config.model import DataSection, ModelSection, TokenizerSection
from jaxrl_tools.config.rollout import EnvSection, RolloutSection, ToolSpec, _check_tool
from jaxrl_tools.config.trainer import TrainerSection
from jaxrl_tools.config.training import (
    AlgorithmSection,
    CriticSection,
    OptimSection,
    RewardSpec,
    SFTSection,
)

# What provides each advantage-estimator input beyond scores and the loss mask (the greedy
# baseline rollout is always available: the sampler runs it when the estimator reads it).
ADVANTAGE_INPUT_SOURCES = {
    "values_BT": "a critic (critic.enabled: true)",
    "kl_BT": "algorithm.kl_in_reward with kl_coef > 0",
    "step_rewards_BS": "multi-turn environment steps (an env section: env.name)",
}
STEP_INPUTS = {"step_rewards_BS", "step_mask_BS", "anchor_ids_BS", "token_step_BT"}
# The rollout.agent of data.verifiers: each run one episode of the taskset's environment.
VERIFIERS_AGENT = "jaxrl_tools.agents.verifiers_envs:episode"


def _default_rewards() -> tuple[RewardSpec, ...]:
    return (RewardSpec("math", 1.0, {}),)


@dataclass(frozen=True)
class RunConfig:
    """The whole run."""

    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    tools: tuple[ToolSpec, ...] = ()
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    reward: tuple[RewardSpec, ...] = field(default_factory=_default_rewards)
    optim: OptimSection = field(default_factory=OptimSection)
    critic: CriticSection = field(default_factory=CriticSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    sft: SFTSection = field(default_factory=SFTSection)
    env: EnvSection = field(default_factory=EnvSection)

    def __post_init__(self):
        if self.data.verifiers is not None:  # its episodes are the rollouts
            _check(
                self.rollout.agent in (None, VERIFIERS_AGENT),
                "rollout.agent",
                f"is {self.rollout.agent!r}, but data.verifiers runs the taskset's own "
                "episodes: remove rollout.agent",
            )
            object.__setattr__(
                self, "rollout", dataclasses.replace(self.rollout, agent=VERIFIERS_AGENT)
            )
        est, r = self.algorithm.adv_estimator, self.rollout
        # A group of one response, or of identical greedy ones, gets zero advantages everywhere.
        if algorithms.uses_group_baseline(est):
            _check(
                r.group_size >= 2,
                "rollout.group_size",
                f"must be >= 2 for algorithm.adv_estimator={est!r}: a group of one response gets "
                "zero advantages (use several samples per prompt, or a critic: "
                "adv_estimator=gae with critic.enabled=true)",
            )
            _check(
                r.temperature > 0,
                "rollout.temperature",
                f"must be > 0 for algorithm.adv_estimator={est!r}: greedy sampling makes the "
                "responses of a group identical and every advantage zero",
            )
        o = self.optim
        _check(
            self.model.attention != "cudnn" or not (o.pack or o.share_prefix or self.sft.pack),
            "model.attention",
            "'cudnn' takes no packed rows (jax's API has no segment ids): use 'auto' or "
            "'chunked', or set optim.pack, optim.share_prefix and sft.pack to false",
        )
        row = self.rollout.max_prompt_len + self.rollout.max_response_len
        _check(
            o.pack_width is None or o.pack_width >= row,
            "optim.pack_width",
            f"must hold a whole row: at least rollout.max_prompt_len + max_response_len = {row}",
        )
        _check(
            self.model.attention != "pallas" or not o.share_prefix,
            "model.attention",
            "'pallas' takes sequences a multiple of 128 long, and shared prompt slots are "
            "not: use 'auto' (it runs the kernel where the shapes allow) or set "
            "optim.share_prefix to false",
        )
        if self.tokenizer.path is None:
            _check(
                self.model.path is not None,
                "tokenizer.path",
                "must be set when model.path is null (a tiny model has no tokenizer of its own)",
            )
        names = [t.name or t.cls for t in self.tools]
        dup = {n for n in names if names.count(n) > 1}
        _check(not dup, "tools", f"has duplicate tool names {sorted(dup)}")
        for i, spec in enumerate(self.reward):
            if ":" not in spec.name:  # "module:function" names are imported by the rewards lib
                _check_choice(spec.name, f"reward[{i}].name", rewards.registered_rewards())
        for i, spec in enumerate(self.tools):
            _check_tool(spec, f"tools[{i}]")
        self._check_artist_tags(names)
        given = {"values_BT"} if self.critic.enabled else set()
        given.add("baseline_B")  # the sampler's greedy rollout (ReMax)
        if self.env.name is not None:
            given |= STEP_INPUTS
        if self.algorithm.kl_in_reward and self.algorithm.kl_coef > 0:
            given.add("kl_BT")
        est = self.algorithm.adv_estimator
        if "kl_BT" in given and "kl_BT" not in algorithms.estimator_inputs(est):
            takes = [
                n
                for n in algorithms.list_advantage_estimators()
                if "kl_BT" in algorithms.estimator_inputs(n)
            ]
            raise ConfigError(
                f"algorithm.kl_in_reward: adv_estimator={est!r} has no token rewards to fold "
                f"the KL into (it would be dropped); set kl_in_reward=false (KL in the loss) or "
                f"use one of {takes}"
            )
        if self.rollout.agent is not None:
            _check(
                self.env.name is None and self.rollout.protocol in ("qwen", "none"),
                "rollout.agent",
                "brings its own loop: tool calls reach it as OpenAI tool_calls "
                "(rollout.protocol: qwen, or none for plain text) and no env section is stepped; "
                f"got rollout.protocol={self.rollout.protocol!r}"
                + (f", env.name={self.env.name!r}" if self.env.name is not None else ""),
            )
        if self.rollout.template == "plain":
            _check(
                self.env.name is None and self.rollout.agent is None,
                "rollout.template",
                "'plain' renders a prompt and one response; environments and agents take chat "
                "turns: use template: chat",
            )
        if self.env.windowed:
            _check(
                not self.tools,
                "tools",
                f"are not supported with env.history={self.env.history!r}: a windowed turn is "
                "one model segment, with no tool calls inside it; use env.history=full",
            )
            _check(
                algorithms.turn_level(est),
                "algorithm.adv_estimator",
                f"is {est!r}, which gives each token its own advantage; env.history="
                f"{self.env.history!r} trains every turn as its own row, so it needs one of "
                f"{[n for n in algorithms.list_advantage_estimators() if algorithms.turn_level(n)]}"
                " (or env.history=full)",
            )
        missing = set(algorithms.estimator_requirements(est)) - given
        if missing:
            need = sorted(
                {
                    ADVANTAGE_INPUT_SOURCES.get(m, ADVANTAGE_INPUT_SOURCES["step_rewards_BS"])
                    for m in missing
                }
            )
            raise ConfigError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} needs "
                f"{' and '.join(need)}, which this run does not provide"
            )

    def _check_artist_tags(self, tool_names: list[str]) -> None:
        """ARTIST's format reward reads the tags the rollout has the model write: with other
        tags it scores 0 on every response, silently."""
        if self.rollout.tool_tags == "tool":
            want = ["tool"]
        elif any(":" in t.cls and not t.name for t in self.tools):
            return  # a user's tool class names itself: known only once it is built
        else:
            want = sorted(tool_names)
        for i, spec in enumerate(self.reward):
            got = sorted(spec.kwargs.get("tool_tags") or ["tool"])
            _check(
                spec.name != "artist_format" or got == want,
                f"reward[{i}].kwargs.tool_tags",
                f"is {got}, but rollout.tool_tags={self.rollout.tool_tags!r} has the model tag "
                f"its calls {want}: the format reward would be 0 on every response; set "
                f"tool_tags: {want}",
            )

    @property
    def update_rows(self) -> int:
        """Sequences in one update: prompts x G; with windowed history (a row per turn),
        x `env.max_turns`; with an agent that may rewrite its history, x
        `rollout.agent_max_samples`."""
        rows = self.data.batch_size * self.rollout.group_size
        if self.rollout.agent is not None:
            return rows * self.rollout.agent_max_samples
        return rows * self.env.max_turns if self.env.windowed else rows

    @property
    def use_reference_model(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.path if self.tokenizer.path is not None else str(self.model.path)
