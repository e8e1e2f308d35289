"""Pre-flight checks: a whole run validated before anything expensive, and what it would do.

    summary = check.preflight(cfg)  # ConfigError: one line naming the field or file, and the fix
    print(check.format_summary(summary))

`run.train` calls `preflight` before it loads a model; `jaxrl-tools check` prints its summary.
The config itself was validated when it was loaded (`config.py`); these checks read the world
around it: the model folder, the tokenizer, the data files line by line, prompt lengths through
the chat template, the tools (built, not started), the rewards' arguments, the devices against
the mesh, the batch split, the model's positions, and whether the output folders take a file.
Each `check_*` function checks one thing and raises `ConfigError`; none writes into a model
folder, and a failed check leaves nothing behind. What a run reads comes from its own loaders
(`records` for prompt records and SFT traces, `setup.setup_tokenizer` for the tokenizer): the
checks call them and word their errors, and the run never imports this package to load data.
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.check.inputs import (
        check_data,
        check_model,
        check_positions,
        check_prompt_lengths,
        check_sft,
        check_tokenizer,
        read_split,
        tiny_model_config,
    )
    from jaxrl_tools.check.preflight import format_summary, preflight, preflight_eval, preflight_sft
    from jaxrl_tools.check.setup import (
        build_tools,
        check_batch,
        check_mesh,
        check_new_output,
        check_rewards,
        check_tools,
        check_writable,
        tools_schema,
    )

__all__ = [
    "build_tools",
    "check_batch",
    "check_data",
    "check_mesh",
    "check_model",
    "check_new_output",
    "check_positions",
    "check_prompt_lengths",
    "check_rewards",
    "check_sft",
    "check_tokenizer",
    "check_tools",
    "check_writable",
    "format_summary",
    "preflight",
    "preflight_eval",
    "preflight_sft",
    "read_split",
    "tiny_model_config",
    "tools_schema",
]

__getattr__, __dir__ = lazy_api(__name__)
