"""Walking a module's inputs and outputs: the tensors in nests of containers.

The hooks cast floating-point inputs (mixed precision), route inputs that need grad
through the post-backward node and register the pre-backward hook on outputs; all of it
needs every tensor in whatever the module takes and returns, and the common case (one
plain tensor in, one out) must not pay for a general walk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nest of containers to ``dtype``."""
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


# Module inputs and outputs are walked with pytree (containers, namedtuples, registered
# classes such as Hugging Face's ModelOutput) and, inside it, through dataclass instances
# pytree does not know, which it would take for opaque leaves: their tensors would miss
# the casts and the backward triggers.
def _plain_tensors(tree: Any) -> tuple[torch.Tensor, ...] | None:
    """The leaves of ``tree`` if it is a plain ``torch.Tensor`` or a hook's ``(args, kwargs)``
    with only plain tensors in ``args`` and no ``kwargs``; else None.

    The common case of every hook call (a block called with activations, returning one),
    handled without pytree, whose flatten and unflatten cost 10-30 us per call. Only exact
    ``torch.Tensor`` objects qualify: pytree takes them for leaves, while a subclass could be
    registered as a pytree node (and a container needs the general walk anyway)."""
    if type(tree) is torch.Tensor:
        return (tree,)
    if type(tree) is tuple and len(tree) == 2:
        args, kwargs = tree
        if (
            type(args) is tuple
            and type(kwargs) is dict
            and not kwargs
            and all(type(x) is torch.Tensor for x in args)
        ):
            return args
    return None


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, dataclass fields included."""
    plain = _plain_tensors(tree)
    if plain is not None:
        return list(plain)
    out: list[torch.Tensor] = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif _is_dataclass_instance(leaf):
            for field in dataclasses.fields(leaf):
                out += tensors_in(getattr(leaf, field.name))
    return out


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``x`` replaced by ``fn(x)``; dataclass instances are
    rebuilt with ``dataclasses.replace`` where a field changed."""
    plain = _plain_tensors(tree)
    if plain is not None:  # a tensor, or (args, {}): rebuilt as tree_unflatten would
        if type(tree) is torch.Tensor:
            return fn(tree)
        return tuple(fn(x) for x in plain), {}
    leaves, spec = tree_flatten(tree)
    mapped = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = fn(leaf)
        elif _is_dataclass_instance(leaf):
            changes = {}
            for field in dataclasses.fields(leaf):
                value = getattr(leaf, field.name)
                new = map_tensors(fn, value)
                if field.init and new is not value:
                    changes[field.name] = new
            if changes:
                leaf = dataclasses.replace(leaf, **changes)
        mapped.append(leaf)
    return tree_unflatten(mapped, spec)


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def hook_first_gradient(output: Any, hook: Callable[..., None]) -> None:
    """Run ``hook`` once per backward, when the first gradient of ``output``'s tensors
    that need one is computed: fsdp2's pre-backward trigger, and the planner's record
    of it (which must fire where the runtime's does).

    An output that is a view (``h.view(b, s, d)``) loses its hook if the caller modifies
    it in place (``y += 1``): autograd rebases the view on its base, and the view's old
    node, where the hook sits, leaves the graph; backward would then run on freed
    parameters. Hooking the base too (a non-leaf made in this forward) keeps a trigger on
    the path; whichever fires first runs the hook, once."""
    tensors = [x for x in tensors_in(output) if x.requires_grad]
    bases = [
        x._base
        for x in tensors
        if x._is_view() and x._base is not None and x._base.grad_fn is not None
    ]
    tensors += [b for b in bases if not any(b is t for t in tensors)]
    if len(tensors) == 1:
        # What register_multi_grad_hook(mode="any") does for one tensor, without its
        # per-call set-up (~20 us): a tensor's hook runs once per backward anyway.
        tensors[0].register_hook(hook)
    elif tensors:
        register_multi_grad_hook(tensors, hook, mode="any")
