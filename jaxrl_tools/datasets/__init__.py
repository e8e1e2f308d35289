"""Datasets as records: generated function-calling data and converters from public formats."""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.datasets.function_calling import (
        call_metrics,
        convert,
        from_bfcl,
        from_hermes,
        from_toolace,
        from_xlam,
        generate,
        split_turns,
        valid_record,
    )

__all__ = [
    "call_metrics",
    "convert",
    "from_bfcl",
    "from_hermes",
    "from_toolace",
    "from_xlam",
    "generate",
    "split_turns",
    "valid_record",
]

__getattr__, __dir__ = lazy_api(__name__)
