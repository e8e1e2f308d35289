"""Device mesh, logical-axis sharding rules, sharded initialisation and multi-host start-up.

Parameters and activations are annotated with logical axis names (`batch`, `length`, `embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `layers`); one rules table maps them to the mesh
axes (`data`, `fsdp`, `tensor`).
"""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.sharding.distributed import (
        agree,
        initialize_distributed,
        is_main_process,
        is_multiprocess,
    )
    from jaxrl_tools.sharding.mesh import MESH_AXES, make_mesh, parse_mesh_shape
    from jaxrl_tools.sharding.rules import (
        DEFAULT_RULES,
        LOGICAL_AXES,
        call_in_mesh,
        constrain,
        current_mesh,
        logical_to_spec,
        put_sharded,
        sharded_init,
        tree_shardings,
        use_mesh,
    )

__all__ = [
    "DEFAULT_RULES",
    "LOGICAL_AXES",
    "MESH_AXES",
    "agree",
    "call_in_mesh",
    "constrain",
    "current_mesh",
    "initialize_distributed",
    "is_main_process",
    "is_multiprocess",
    "logical_to_spec",
    "make_mesh",
    "parse_mesh_shape",
    "put_sharded",
    "sharded_init",
    "tree_shardings",
    "use_mesh",
]

__getattr__, __dir__ = lazy_api(__name__)
