"""Tools for tool-using RL: protocol, parsers, sandboxed Python, search, calculator.

Public API (see each module's docstring):
  Observation, Tool, register_tool, create_tool, load_tools_yaml, TOOL_REGISTRY,
  truncate_middle, last_traceback_line                       (base)
  ToolCall, ParseResult, get_parser + the parser classes,
  read_tool_calls (the lenient <tool_call> reader of rewards) (parsers)
  ToolExecutor, validate_arguments                            (executor)
  SandboxConfig, SandboxUnavailableError, check_isolation     (sandbox)
  SandboxPool, ExecResult                                     (pool)
  run_code, run_code_sync, make_http_server                   (sandbox_fusion)
  PythonTool, SearchTool, BM25Index, CalculatorTool, safe_eval, function_tool
  WebSearchTool, BrowseTool, WebBackend, LocalPages, SearchHit (DeepResearcher: browse)
  McpServer ("mcp": a server's tools, one McpTool each)     (mcp; needs the `mcp` extra)
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.tools.base import (
        TOOL_REGISTRY,
        Observation,
        Tool,
        create_tool,
        last_traceback_line,
        load_tools,
        load_tools_yaml,
        register_tool,
        tool_class,
        truncate_middle,
    )
    from jaxrl_tools.tools.browse import (
        BrowseTool,
        LocalPages,
        SearchHit,
        WebBackend,
        WebSearchTool,
    )
    from jaxrl_tools.tools.calculator import CalculatorError, CalculatorTool, safe_eval
    from jaxrl_tools.tools.executor import ToolExecutor, validate_arguments
    from jaxrl_tools.tools.functions import FunctionTool, function_tool
    from jaxrl_tools.tools.mcp import McpServer, McpTool
    from jaxrl_tools.tools.parsers import (
        PARSERS,
        Parser,
        ParseResult,
        QwenParser,
        ReToolParser,
        SearchR1Parser,
        ToolCall,
        ToRLParser,
        declares_tools,
        get_parser,
        read_tool_calls,
    )
    from jaxrl_tools.tools.pool import ExecResult, SandboxPool
    from jaxrl_tools.tools.python_tool import PythonTool
    from jaxrl_tools.tools.sandbox import SandboxConfig, SandboxUnavailableError, check_isolation
    from jaxrl_tools.tools.sandbox_fusion import make_http_server, run_code, run_code_sync
    from jaxrl_tools.tools.search import BM25Index, SearchTool, format_passages

__all__ = [
    "PARSERS",
    "TOOL_REGISTRY",
    "BM25Index",
    "BrowseTool",
    "CalculatorError",
    "CalculatorTool",
    "ExecResult",
    "FunctionTool",
    "Observation",
    "ParseResult",
    "Parser",
    "PythonTool",
    "QwenParser",
    "ReToolParser",
    "SandboxConfig",
    "SandboxPool",
    "SandboxUnavailableError",
    "SearchR1Parser",
    "SearchTool",
    "ToRLParser",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "WebBackend",
    "WebSearchTool",
    "check_isolation",
    "create_tool",
    "format_passages",
    "function_tool",
    "LocalPages",
    "McpServer",
    "McpTool",
    "SearchHit",
    "get_parser",
    "last_traceback_line",
    "load_tools",
    "load_tools_yaml",
    "declares_tools",
    "make_http_server",
    "register_tool",
    "tool_class",
    "run_code",
    "run_code_sync",
    "read_tool_calls",
    "safe_eval",
    "truncate_middle",
    "validate_arguments",
]

__getattr__, __dir__ = lazy_api(__name__)
