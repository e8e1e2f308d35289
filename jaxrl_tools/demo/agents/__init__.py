"""Example agents written with agent SDKs, trained as they are (`rollout.agent`): each is an
async function(client, record) that builds the SDK's own model object on the gateway's client
and solves the record's task with one calculator tool.

  rollout.agent=jaxrl_tools.demo.agent:tool_math_agent              the plain `openai` client
  rollout.agent=jaxrl_tools.demo.agents.openai_agents:agent        OpenAI Agents SDK (Responses)
  rollout.agent=jaxrl_tools.demo.agents.langchain_agent:agent      LangChain (ChatOpenAI)
  rollout.agent=jaxrl_tools.demo.agents.smolagents_agent:agent     smolagents (ToolCallingAgent)

The SDK is imported when the agent runs (pip install openai-agents / langchain-openai /
smolagents). Each returns None: the recipe's reward scores what the policy wrote. An SDK error
(too many turns, a call it cannot run) ends the episode the same way, not the rollout.
"""

from jaxrl_tools.tools.calculator import CalculatorError, format_number, safe_eval

MAX_TURNS = 4


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression (the SDKs wrap this function as their tool)."""
    try:
        return format_number(safe_eval(expression))
    except (CalculatorError, SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
