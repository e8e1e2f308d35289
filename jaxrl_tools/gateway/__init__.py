"""The OpenAI-compatible gateway over the policy: `serve --openai`, and the client of agents
trained as plain client code (`rollout.agent`)."""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.gateway.backend import Backend, BadRequest, Chat, Completion, Generation

__all__ = ["BadRequest", "Backend", "Chat", "Completion", "Generation"]

__getattr__, __dir__ = lazy_api(__name__)
