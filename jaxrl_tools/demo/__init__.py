"""The demo: the `demo` command that runs a recipe's SFT, RL and reports (`runner`), its
per-seed spread (`seeds`), the held-out report (`report`), and the agents written as client
code that demos train (`agent`, `agents/`). The generated tasks are `jaxrl_tools.tasks`."""
