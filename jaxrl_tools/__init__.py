"""jaxrl-tools: agentic, tool-using reinforcement learning of LLMs in JAX/Flax."""

__version__ = "0.1.0"
