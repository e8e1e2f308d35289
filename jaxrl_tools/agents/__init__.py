"""Agents written as client code, trained through the gateway: each agent run's requests become
one trajectory (`rollouts`: `run_agent_rollouts`, `load_agent`, `http_base_url` for agents that
need a URL); verifiers' environments played as such agents (`verifiers_envs`). Above both the
gateway and the rollout loop, which they join."""
