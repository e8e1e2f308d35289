"""The OpenAI-compatible gateway over the policy: `serve --openai`, and the client of agents
trained as plain client code (`rollout.agent`)."""

from jaxrl_tools.gateway.backend import Backend, BadRequest, Chat, Completion, Generation

__all__ = ["BadRequest", "Backend", "Chat", "Completion", "Generation"]
