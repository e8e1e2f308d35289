"""Rule-based rewards, chosen by name from one registry and composed (`CompositeReward`).

Importing the package registers every reward: outcome (math, qa_em, format, exec_penalty,
tool_success, retool, dapo_overlong, env_return), tool calls (toolrl, tool_n1), OTC (otc_ppo,
otc_grpo), DeepRetrieval's (retrieval, sql_exec) and ARTIST's (artist_answer, artist_format).
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.rewards import deadline
    from jaxrl_tools.rewards.answers import (
        CORRECTNESS_CHECKERS,
        is_correct,
        last_answer_tag,
        last_boxed,
        math_correct,
        math_equal,
        normalize_answer,
        qa_correct,
        tags_in_order,
    )
    from jaxrl_tools.rewards.artist import (
        artist_answer_reward,
        artist_format_ok,
        artist_format_reward,
        artist_tag_sequence,
    )
    from jaxrl_tools.rewards.otc import (
        otc_grpo_reward,
        otc_grpo_tool_reward,
        otc_map,
        otc_ppo_reward,
        otc_ppo_tool_reward,
    )
    from jaxrl_tools.rewards.outcome import (
        dapo_overlong_reward,
        env_return_reward,
        exec_penalty_reward,
        format_reward,
        math_reward,
        qa_em_reward,
        retool_reward,
        tool_success_reward,
    )
    from jaxrl_tools.rewards.registry import (
        TIMEOUTS,
        CompositeReward,
        RewardError,
        TrajectoryInfo,
        get_reward,
        register_reward,
        registered_rewards,
    )
    from jaxrl_tools.rewards.retrieval import (
        ndcg_at_k,
        recall_at_k,
        retrieval_reward,
        run_readonly,
        sql_exec_reward,
    )
    from jaxrl_tools.rewards.tool_calls import tool_n1_reward, toolrl_correctness, toolrl_reward

__all__ = [
    "artist_answer_reward",
    "artist_format_ok",
    "artist_format_reward",
    "artist_tag_sequence",
    "CORRECTNESS_CHECKERS",
    "CompositeReward",
    "deadline",
    "TIMEOUTS",
    "RewardError",
    "TrajectoryInfo",
    "get_reward",
    "is_correct",
    "last_answer_tag",
    "last_boxed",
    "math_correct",
    "math_equal",
    "normalize_answer",
    "qa_correct",
    "register_reward",
    "registered_rewards",
    "tags_in_order",
    "toolrl_correctness",
    "otc_grpo_tool_reward",
    "otc_map",
    "otc_ppo_tool_reward",
    "otc_ppo_reward",
    "otc_grpo_reward",
    "math_reward",
    "qa_em_reward",
    "format_reward",
    "exec_penalty_reward",
    "tool_success_reward",
    "retool_reward",
    "dapo_overlong_reward",
    "env_return_reward",
    "toolrl_reward",
    "tool_n1_reward",
    "ndcg_at_k",
    "recall_at_k",
    "retrieval_reward",
    "run_readonly",
    "sql_exec_reward",
]

__getattr__, __dir__ = lazy_api(__name__)
