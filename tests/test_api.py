"""The public surface: the pinned ``__all__`` and argument validation that happens before
any process group is needed. If a name here changes, users switching from
``torch.distributed.fsdp`` by import break: change the docs and CHANGELOG with it."""

import ast
import pathlib

import pytest
import torch
from torch import nn

import fsdp2


def test_all_is_pinned() -> None:
    assert fsdp2.__all__ == [
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "DivergenceError",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "ModelOptimizerState",
        "OffloadPolicy",
        "ReducePolicy",
        "ScheduleTrace",
        "ShardingPlan",
        "UnshardHandle",
        "clip_grad_norm_",
        "clip_grads_with_norm_",
        "fully_shard",
        "get_full_state_dict",
        "get_total_norm",
        "init_sharded_",
        "load_checkpoint",
        "load_full_state_dict",
        "plan_sharding",
        "register_fsdp_forward_method",
        "save_checkpoint",
        "set_divergence_checks",
        "set_optimizer_fast_path",
        "share_comm_ctx",
        "trace_schedule",
    ]
    for name in fsdp2.__all__:
        assert getattr(fsdp2, name) is not None


def test_data_parallel_mesh_dims_matches_torch() -> None:
    """``fsdp2.DataParallelMeshDims`` has torch's fields, defaults, name properties and
    empty-spec error, so ``from fsdp2 import DataParallelMeshDims`` switches by import."""
    torch_fsdp = pytest.importorskip("torch.distributed.fsdp")
    theirs = getattr(torch_fsdp, "DataParallelMeshDims", None)
    ours = fsdp2.DataParallelMeshDims
    if theirs is not None:
        assert list(ours.__dataclass_fields__) == list(theirs.__dataclass_fields__)
    dims = ours(shard=("dp_shard", "cp"), replicate="dp_replicate")
    assert dims.shard_names == ("dp_shard", "cp")
    assert dims.replicate_names == ("dp_replicate",)
    assert ours(replicate="ddp").shard_names == ()
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        ours()
    with pytest.raises(TypeError, match=r"shard must be a mesh dim name or a tuple of names"):
        ours(shard=0)  # type: ignore[arg-type]


def test_policies_match_torch_defaults() -> None:
    from torch.distributed import fsdp as torch_fsdp

    assert fsdp2.MixedPrecisionPolicy() == fsdp2.MixedPrecisionPolicy(None, None, None, True)
    ours = fsdp2.MixedPrecisionPolicy.__dataclass_fields__.keys()
    theirs = torch_fsdp.MixedPrecisionPolicy.__dataclass_fields__.keys()
    assert list(ours) == list(theirs)
    assert fsdp2.CPUOffloadPolicy().pin_memory is True
    assert isinstance(fsdp2.CPUOffloadPolicy(), fsdp2.OffloadPolicy)


def test_fully_shard_signature_matches_torch() -> None:
    import inspect

    from torch.distributed import fsdp as torch_fsdp

    ours = inspect.signature(fsdp2.fully_shard).parameters
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward"),
        ({"reshard_after_forward": 2.5}, TypeError, "or an int"),
        ({"shard_placement_fn": 3}, TypeError, "callable"),
        ({"mp_policy": "bf16"}, TypeError, "MixedPrecisionPolicy"),
        ({"mp_policy": fsdp2.MixedPrecisionPolicy(param_dtype=torch.int8)}, ValueError, "floating"),
        ({"offload_policy": True}, TypeError, "OffloadPolicy"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fsdp2.fully_shard(nn.Linear(2, 2), **kwargs)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        fsdp2.fully_shard(torch.ones(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty list"):
        fsdp2.fully_shard([])


def _container(kind: type) -> nn.Module:
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    return kind(layers) if kind is nn.ModuleList else kind(dict(zip("ab", layers)))


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
@pytest.mark.parametrize("kind", [nn.ModuleList, nn.ModuleDict])
def test_container_without_forward(impl: str, kind: type) -> None:
    """torch rejects a ModuleList/ModuleDict up front; fsdp2 accepted it and then failed in
    forward with a DTensor/Tensor mix (the container's hooks never run)."""
    if impl == "fsdp2":
        fully_shard = fsdp2.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    match = "containers? (that do not implement|without) forward"
    with pytest.raises(ValueError, match=match):
        fully_shard(_container(kind))
    if impl == "fsdp2":  # in a group of several modules too
        with pytest.raises(ValueError, match=match):
            fully_shard([nn.Linear(2, 2), _container(kind)])


def _patch_after_sharding(impl: str) -> dict[str, object]:
    """Shard a module, then patch its class (as Liger-Kernel patches
    ``LlamaForCausalLM.forward``), then shard another module of the class."""
    from _helpers import get_fully_shard

    fully_shard = get_fully_shard(impl)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def extra(self) -> str:
            return "original"

    before = Net()
    fully_shard(before)

    def patched_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 0 + 7  # the parameters are gathered: the hooks still run

    Net.forward = patched_forward  # type: ignore[method-assign]
    Net.extra = staticmethod(lambda: "patched")  # type: ignore[method-assign,assignment]
    after = Net()
    fully_shard(after)
    x = torch.ones(2, 4)
    return {
        "before": (before(x).eq(7).all().item(), before.extra()),
        "after": (after(x).eq(7).all().item(), after.extra()),
    }


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_class_patched_after_sharding_reaches_every_module(impl: str) -> None:
    """[Note: methods looked up at call time]: a patch of the original class reaches
    modules sharded before and after it, as with torch's ``FSDP<Name>`` (which only adds
    ``FSDPModule`` to the bases); fsdp2's wrappers held the functions they found when
    the class was first made, so the patch silently did nothing."""
    from _launcher import run_ranks

    facts = run_ranks(_patch_after_sharding, 1, impl)[0]
    assert facts == {"before": (True, "patched"), "after": (True, "patched")}, facts


def test_needs_process_group_for_default_mesh() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsdp2.fully_shard(nn.Linear(2, 2))


def test_fsdp_module_methods_match_torch() -> None:
    """Every public FSDPModule method torch has exists here with the same parameters
    (names, kinds, defaults), so calls written against torch keep working."""
    import inspect

    from torch.distributed import fsdp as torch_fsdp

    def params(fn: object) -> list[tuple[str, object, object]]:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    theirs = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")}
    ours = {n for n in dir(fsdp2.FSDPModule) if not n.startswith("_")}
    assert theirs <= ours, sorted(theirs - ours)
    for name in sorted(theirs):
        assert params(getattr(fsdp2.FSDPModule, name)) == params(
            getattr(torch_fsdp.FSDPModule, name)
        ), name


def test_package_never_imports_torch_fsdp() -> None:
    """fsdp2 is built on torch's public pieces only: no import of torch.distributed.fsdp
    anywhere in the package (checked on the source, including imports inside functions)."""
    import ast
    import pathlib

    offenders = []
    for path in sorted(pathlib.Path(fsdp2.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(
                n == "torch.distributed.fsdp" or n.startswith("torch.distributed.fsdp.")
                for n in names
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


# The package's modules from the public API down to stream utilities (docs/design.md);
# a module may import only modules after it.
MODULE_CHAIN = [
    "__init__",
    "plan",  # the subpackage: above the runtime; its own modules follow PLAN_CHAIN
    "trace",
    "_trace_views",
    "pipelining",
    "optim",
    "clip_grad",
    "_checkpoint",
    "_fully_shard",
    "_init",
    "_state",
    "_backward_hooks",
    "_backward_nodes",
    "_module_io",
    "_rank_agreement",
    "_param_group",
    "_all_gather",
    "_grad_reduce",
    "_replica_sum",
    "_grad_pack",
    "_reduction",
    "_unsharded_upkeep",
    "_comm_context",
    "_host_buffers",
    "_param",
    "_spmd",
    "_extensions",
    "_collectives",
    "_fingerprints",
    "_divergence",
    "_comm_records",
    "_stream_utils",
    "_policies",
    "_switches",
]


# fsdp2/plan/ (the planner): its modules in reading order. Each imports only plan modules
# below it and runtime modules (MODULE_CHAIN below "plan"); nothing in the runtime imports
# it (the chain above puts "plan" over every runtime module).
PLAN_CHAIN = [
    "__init__",
    "__main__",
    "_plan_sharding",
    "_grouping",
    "_evaluate",
    "_sharding_plan",
    "_simulate",
    "_trace",
    "_optimizer",
    "_model",
    "_layout",
]


def _fsdp2_imports(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """``(line, [dotted target under fsdp2])`` for every import of ``path`` naming fsdp2
    (including imports inside functions and under ``TYPE_CHECKING``): ``from fsdp2 import
    _stream_utils`` gives ``["_stream_utils"]``, ``from fsdp2.plan._model import y``
    ``["plan", "_model"]``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom) and node.module == "fsdp2":
            targets = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp2."):
            targets = [(node.module or "").split(".")[1:]]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("fsdp2.")]
        for target in targets:
            out.append((node.lineno, target))
    return out


def test_imports_point_down_the_chain() -> None:
    """Every fsdp2 module is placed in ``MODULE_CHAIN`` (the planner's in ``PLAN_CHAIN``)
    and imports only modules below it (including imports inside functions and under
    ``TYPE_CHECKING``)."""
    package = pathlib.Path(fsdp2.__file__).parent
    assert sorted(p.stem for p in package.glob("*.py")) == sorted(
        m for m in MODULE_CHAIN if m != "plan"
    )
    assert sorted(p.stem for p in (package / "plan").glob("*.py")) == sorted(PLAN_CHAIN)
    upward = []
    for path in sorted(package.glob("*.py")):
        for line, target in _fsdp2_imports(path):
            if MODULE_CHAIN.index(target[0]) <= MODULE_CHAIN.index(path.stem):
                upward.append(f"{path.name}:{line} imports {'.'.join(target)}")
    for path in sorted((package / "plan").glob("*.py")):
        for line, target in _fsdp2_imports(path):
            if target[0] == "plan":
                inner = target[1] if len(target) > 1 else "__init__"
                wrong = PLAN_CHAIN.index(inner) <= PLAN_CHAIN.index(path.stem)
            else:  # the runtime, below the planner
                wrong = MODULE_CHAIN.index(target[0]) <= MODULE_CHAIN.index("plan")
            if wrong:
                upward.append(f"plan/{path.name}:{line} imports {'.'.join(target)}")
    assert upward == []


def test_private_unshard_async_op_switch_is_accepted() -> None:
    """torch's ``_set_unshard_async_op`` is called by recipes written for torch."""
    assert callable(fsdp2.FSDPModule._set_unshard_async_op)
    with pytest.raises(TypeError, match="expects a bool"):
        fsdp2.FSDPModule._set_unshard_async_op(object.__new__(fsdp2.FSDPModule), 1)  # type: ignore[arg-type]


def test_integrations_snippet_points_torch_names_at_fsdp2() -> None:
    """docs/integrations.md's snippet (run as written, in a fresh interpreter) makes the
    names frameworks import from torch's FSDP packages fsdp2's."""
    import pathlib
    import re
    import subprocess
    import sys

    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
    match = re.search(r"```python\n(.*?)```", doc.read_text(), re.DOTALL)
    assert match, f"no python block in {doc}"
    check = (
        "\nimport torch.distributed.fsdp\n"
        "from torch.distributed._composable.fsdp import FSDPModule, fully_shard\n"
        "assert torch.distributed.fsdp.fully_shard is fsdp2.fully_shard\n"
        "assert torch.distributed.fsdp.FSDPModule is fsdp2.FSDPModule\n"
        "assert (FSDPModule, fully_shard) == (fsdp2.FSDPModule, fsdp2.fully_shard)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", match.group(1) + check], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


_DEFAULT_GROUP_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
if "{impl}" == "fsdp2":
    from fsdp2 import fully_shard
else:
    from torch.distributed.fsdp import fully_shard
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
for layer in model:
    fully_shard(layer)
fully_shard(model)
model(torch.randn(2, 4)).sum().backward()
print("initialized", dist.is_initialized(), dist.get_world_size())
"""


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_fully_shard_without_mesh_initializes_the_default_group(impl: str) -> None:
    """With no mesh and no process group yet, ``fully_shard`` initializes the default group
    from the environment (what torchrun sets), as torch's does, and trains; without that
    environment the error says what to do."""
    import os
    import pathlib
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    script = _DEFAULT_GROUP_SCRIPT.replace("{impl}", impl)
    ranked = {**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    ranked["MASTER_PORT"] = str(port)
    result = subprocess.run(
        [sys.executable, "-c", script], env=ranked, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "initialized True 1" in result.stdout, result.stdout
    if impl == "fsdp2":
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode != 0
        assert "could not initialize one from the environment" in result.stderr, result.stderr
        assert "init_process_group" in result.stderr, result.stderr
