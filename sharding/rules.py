"""Logical axis names -> mesh axes, by one rules table.

Each parameter and activation names its dimensions with logical axes. `DEFAULT_RULES` maps each
logical axis to a mesh axis, a tuple of mesh axes, or None (replicated on purpose). A logical axis
missing from the table is an error: new parameters are never silently replicated.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# FSDP over ("data", "fsdp") for the batch and over "fsdp" for the embedding dimension of
# weights; tensor parallelism over heads, MLP and vocabulary.
DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "cache_length": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "lora_rank": None,  # LoRA adapters' rank r: small, replicated (models/lora.py)
}
LOGICAL_AXES = tuple(DEFAULT_RULES)

_CONTEXT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxrl_tools_mesh", default=None
)


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules | None = None, *, where: str = "array"
) -> PartitionSpec:
    """The PartitionSpec for one array's logical axes.

    A mesh axis already used by an earlier dimension is not used again (activations
    [batch, length, embed] put fsdp on batch, not also on embed).

    Raises:
      ValueError: a logical axis has no rule (names `where`, the axis and the known axes).
    """
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    spec = []
    for name in axes:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(
                f"{where}: logical axis {name!r} has no sharding rule; known axes: {sorted(rules)}"
            )
        target = rules[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        free = tuple(t for t in targets if t not in used)
        used.update(free)
        spec.append(None if not free else free[0] if len(free) == 1 else free)
    return PartitionSpec(*spec)


def _check_divisible(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, where: str) -> None:
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        parts = 1
        for a in axes:
            parts *= mesh.shape[a]
        if size % parts:
            raise ValueError(
                f"{where}: dimension {dim} of size {size} cannot be split over mesh axes {axes} "
                f"({parts} devices); use a mesh or rules table that divides it"
            )


def tree_shardings(
    axes_tree: Any, mesh: Mesh, rules: Rules | None = None, shapes: Any = None
) -> Any:
    """NamedShardings for a tree of logical-axis tuples (leaves are tuples of names).

    With `shapes` (a matching tree of arrays or ShapeDtypeStructs), divisibility is checked and a
    rank mismatch is an error naming the parameter.
    """
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)
    paths_axes = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=is_axes)[0]
    treedef = jax.tree_util.tree_structure(axes_tree, is_leaf=is_axes)
    shape_leaves = None
    if shapes is not None:
        shape_leaves = treedef.flatten_up_to(shapes)
    out = []
    for i, (path, axes) in enumerate(paths_axes):
        where = jax.tree_util.keystr(path) or "array"
        spec = logical_to_spec(axes, rules, where=where)
        if shape_leaves is not None:
            shape = tuple(shape_leaves[i].shape)
            if len(shape) != len(axes):
                raise ValueError(f"{where}: shape {shape} has rank {len(shape)}, axes {axes}")
            _check_divisible(shape, spec, mesh, where)
        out.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(treedef, out)


def put_sharded(tree: Any, axes_tree: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Places each leaf of `tree` on the mesh by its logical axes (one leaf at a time)."""
    shardings = tree_shardings(axes_tree, mesh, rules, shapes=tree)
    return jax.tree.map(jax.device_put, tree, shardings)


def sharded_init(
    init_fn: Callable[..., Any],
    axes_tree: Any,
    mesh: Mesh,
    *args: Any,
    rules: Rules | None = None,
) -> Any:
    """Runs `init_fn(*args)` so that every output is created already sharded.

    eval_shape -> shardings -> jit(init_fn, out_shardings=...): no full copy on one device.
    """
    shapes = jax.eval_shape(init_fn, *args)
    shardings = tree_shardings(axes_tree, mesh, rules, shapes=shapes)
    with use_mesh(mesh, rules):
        return jax.jit(init_fn, out_shardings=shardings)(*args)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None) -> Iterator[Mesh]:
    """Makes `constrain` place activations on `mesh` by `rules` inside this block."""
    token = _CONTEXT.set((mesh, DEFAULT_RULES if rules is None else rules))
    try:
        yield mesh
    finally:
        _CONTEXT.reset(token)


def call_in_mesh(mesh: Mesh | None, rules: Rules | None, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` inside `use_mesh(mesh, rules)` (the models' activation
    constraints), or plainly without a mesh (one device)."""
    if mesh is None:
        return fn(*args, **kwargs)
    with use_mesh(mesh, rules):
        return fn(*args, **kwargs)


def current_mesh() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) set by the innermost `use_mesh`, or None."""
    return _CONTEXT.get()


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axes.

    Outside `use_mesh` there is no mesh to place on (one device), and `x` is returned unchanged.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    spec = logical_to_spec(axes, rules, where="activation")
    _check_divisible(x.shape, spec, mesh, "activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
