"""What the planner reads from the model: modules, parameters, buffers, and which
parameters each planned ``fully_shard`` call would manage.

Only metadata is read (names, shapes, dtypes, ``requires_grad``, identities): the model
may live on the meta device, and nothing in it is changed or copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdp2.plan._layout import ParamInfo

# A planned group: the indices (in ``model.modules()`` order) of the modules that one
# ``fully_shard`` call gets (several: ``fully_shard([a, b])``).
Group = tuple[int, ...]


@dataclass
class ModelInfo:
    model: nn.Module
    modules: list[nn.Module]  # model.modules(): pre-order, the model first
    names: list[str]  # their first FQNs ("" for the model)
    params: list[ParamInfo]  # model.parameters() order
    param_index: dict[int, int]  # id(parameter) -> index
    local_params: list[list[tuple[str, int]]]  # per module: (attribute, parameter index)
    children: list[list[int]]  # per module: child module indices, in order
    parent: list[int]  # per module: its first parent (-1 for the model)
    buffer_bytes: int

    @property
    def label(self) -> str:
        return type(self.model).__name__

    def describe(self, index: int) -> str:
        """A module for messages: ``'layers.0' (TransformerBlock)``, or the model."""
        name = self.names[index]
        cls = type(self.modules[index]).__name__
        return f"'{name}' ({cls})" if name else f"the model ({cls})"

    def describe_group(self, group: Group) -> str:
        return ", ".join(self.describe(m) for m in group)

    def subtree(self, index: int) -> Iterable[int]:
        stack = [index]
        while stack:
            m = stack.pop()
            yield m
            stack.extend(reversed(self.children[m]))

    def is_ancestor(self, ancestor: int, index: int) -> bool:
        while index >= 0:
            if index == ancestor:
                return True
            index = self.parent[index]
        return False

    def subtree_param_count(self, index: int) -> int:
        seen = {p for m in self.subtree(index) for _, p in self.local_params[m]}
        return sum(self.params[p].numel for p in seen)


def read_model(model: nn.Module) -> ModelInfo:
    """The metadata of ``model``; a model without parameters is an error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_sharding expects an nn.Module, got {type(model).__name__}.")
    named = list(model.named_modules())
    modules = [m for _, m in named]
    index = {id(m): i for i, m in enumerate(modules)}
    children = [[index[id(c)] for c in m.children()] for m in modules]
    parent = [-1] * len(modules)
    for i, kids in enumerate(children):
        for c in kids:
            if parent[c] < 0 and c != 0:
                parent[c] = i
    params: list[ParamInfo] = []
    param_index: dict[int, int] = {}
    for fqn, p in model.named_parameters():
        param_index[id(p)] = len(params)
        params.append(ParamInfo(len(params), fqn, tuple(p.shape), p.dtype, p.requires_grad))
    if not params:
        raise ValueError(
            f"plan_sharding: {type(model).__name__} has no parameters, so there is nothing to "
            f"shard; plan the model whose parameters fully_shard should manage."
        )
    local = [
        [(attr, param_index[id(p)]) for attr, p in m._parameters.items() if p is not None]
        for m in modules
    ]
    buffers = {id(b): b for b in model.buffers()}
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers.values())
    return ModelInfo(
        model,
        modules,
        [n for n, _ in named],
        params,
        param_index,
        local,
        children,
        parent,
        buffer_bytes,
    )


def resolve_groups(info: ModelInfo, groups: Sequence[object]) -> list[Group]:
    """User ``groups`` (modules or FQNs, or lists of them for one call), bottom-up, as
    module indices; the model is appended as the root when missing."""
    if isinstance(groups, (str, nn.Module)) or not isinstance(groups, Sequence):
        raise TypeError(
            f"plan_sharding(groups=...) expects 'auto' or a list of submodules or FQNs of "
            f"{info.label} (bottom-up, the root last), got {groups!r}."
        )
    by_name = {name: i for i, name in enumerate(info.names)}
    by_id = {id(m): i for i, m in enumerate(info.modules)}

    def one(item: object) -> int:
        if isinstance(item, nn.Module):
            found = by_id.get(id(item))
            if found is None:
                raise ValueError(
                    f"plan_sharding: groups names a {type(item).__name__} that is not a "
                    f"submodule of {info.label}; pass modules of the planned model, or their "
                    f"FQNs."
                )
            return found
        if isinstance(item, str):
            found = by_name.get(item)
            if found is None:
                close = [n for n in info.names if n and n.endswith(item.split(".")[-1])][:3]
                hint = f" (similar: {', '.join(repr(c) for c in close)})" if close else ""
                raise ValueError(
                    f"plan_sharding: groups names '{item}', which is not a submodule of "
                    f"{info.label}{hint}. Use FQNs as model.named_modules() gives them, "
                    f"'' for the model itself."
                )
            return found
        raise TypeError(
            f"plan_sharding: groups entries must be modules, FQNs, or lists of them (one "
            f"fully_shard call on several modules), got {type(item).__name__}."
        )

    out: list[Group] = []
    for entry in groups:
        if isinstance(entry, (list, tuple)):
            if not entry:
                raise ValueError("plan_sharding: groups holds an empty list of modules.")
            out.append(tuple(one(x) for x in entry))
        else:
            out.append((one(entry),))
    seen: dict[int, int] = {}
    for g, group in enumerate(out):
        for m in group:
            if m in seen:
                raise ValueError(
                    f"plan_sharding: groups lists {info.describe(m)} twice; fully_shard "
                    f"accepts one call per module."
                )
            seen[m] = g
    for g, group in enumerate(out):
        for earlier in out[:g]:
            for m in group:
                for e in earlier:
                    if m != e and info.is_ancestor(e, m):
                        raise ValueError(
                            f"plan_sharding: groups lists {info.describe(m)} after its "
                            f"parent {info.describe(e)}. fully_shard applies bottom-up: the "
                            f"parent's call would already manage the child's parameters. "
                            f"Put {info.describe(m)} before {info.describe(e)}."
                        )
    if 0 not in seen:
        out.append((0,))
    return out


def group_params(info: ModelInfo, groups: Sequence[Group], ignored: set[int]) -> list[list[int]]:
    """The parameters each call manages, in the order ``fully_shard`` discovers them
    (``collect_params``: each module, then its children, skipping modules an earlier call
    sharded). A parameter reachable from two calls is refused, as the runtime refuses it
    at the first forward: tied weights belong in one group."""
    sharded: set[int] = set()
    owner: dict[int, int] = {}
    out: list[list[int]] = []
    for g, group in enumerate(groups):
        tops = set(group)
        found: list[int] = []
        for top in group:
            stack = [top]
            while stack:
                m = stack.pop()
                for _, p in info.local_params[m]:
                    if p in ignored or p in found:
                        continue
                    if p in owner and owner[p] != g:
                        other = groups[owner[p]]
                        raise ValueError(
                            f"plan_sharding: parameter '{info.params[p].fqn}' is used by "
                            f"{info.describe_group(group)} and by {info.describe_group(other)}, "
                            f"which the plan puts in different groups; fully_shard refuses a "
                            f"parameter shared between groups. Put the modules that share it in "
                            f"one group, e.g. [{', '.join(repr(info.names[x]) for x in (*other, *group))}], "
                            f"or leave both to a common ancestor."
                        )
                    owner[p] = g
                    found.append(p)
                for c in reversed(info.children[m]):
                    if c in sharded and c not in tops:
                        continue
                    stack.append(c)
        sharded.update(group)
        out.append(found)
    return out


def ignored_indices(info: ModelInfo, ignored_params: object) -> set[int]:
    if ignored_params is None:
        return set()
    try:
        items = list(ignored_params)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"plan_sharding(ignored_params=...) expects a set of nn.Parameter, got "
            f"{type(ignored_params).__name__}."
        ) from None
    out = set()
    for p in items:
        if not isinstance(p, torch.nn.Parameter):
            raise TypeError(
                f"plan_sharding(ignored_params=...) must contain nn.Parameter objects, got "
                f"{type(p).__name__}."
            )
        index = info.param_index.get(id(p))
        if index is None:
            raise ValueError(
                f"plan_sharding: an ignored parameter of shape {tuple(p.shape)} is not a "
                f"parameter of {info.label}."
            )
        out.add(index)
    return out
