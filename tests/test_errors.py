"""Every validation error fsdp2 raises, provoked once and matched against its message.

Bad input must fail loudly, name the module or parameter, and say what to do instead of
hanging or computing on shards. One rank function on 2 gloo ranks provokes every error
(most need a process group and a mesh) and returns ``{case: (exception type, message)}``;
each case is then a parametrized test, so a changed message fails exactly one test.
Errors that need no process group are in ``test_api.py``.
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class PeeksIntoBlock(Root):
    """Runs a submodule of its first block outside the block's forward (diffusers' DiT
    runs ``transformer_blocks[0].norm1.emb`` after its blocks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peek = self.a.lin(x)
        return self.b(self.a(x)) + peek


class Borrower(Block):
    def forward(self, x: torch.Tensor, other: nn.Module) -> torch.Tensor:  # type: ignore[override]
        return self.lin(x) + other(x)


class LendsToSibling(Root):
    """Block ``b`` runs a submodule of block ``a`` after ``a`` resharded."""

    def __init__(self) -> None:
        super().__init__()
        self.b = Borrower()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x), self.a.lin)


class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.temperature = nn.Parameter(torch.tensor(1.0))


class SparseLookup(nn.Module):
    """A sparse gradient without an ``Embedding(sparse=True)`` that fully_shard could see."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.table, sparse=True)


def _mesh() -> Any:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _sharded_root(cls: type[Root] = Root) -> Root:
    mesh = _mesh()
    model = cls()
    fsdp2.fully_shard(model.a, mesh=mesh)
    fsdp2.fully_shard(model.b, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _case_fns() -> dict[str, Callable[[], object]]:
    """Each function must raise; the key names the case."""
    x = torch.randn(2, 4)

    def forward_called_directly() -> None:
        model = _sharded_root()
        model(x)  # lazy init; every block reshards after forward
        model.a.forward(x)

    def submodule_run_outside_its_group() -> None:
        _sharded_root(PeeksIntoBlock)(x)

    def submodule_run_by_a_sibling() -> None:
        _sharded_root(LendsToSibling)(x)

    def unregistered_method() -> None:
        model = _sharded_root()
        model(x)
        model.a.generate(x)

    def first_forward_not_through_root() -> None:
        model = _sharded_root()
        model.a(x)  # makes `a` the root of its own tree
        model(x)

    def meta_params_at_first_forward() -> None:
        with torch.device("meta"):
            model = Root()
        for module in (model.a, model.b, model):
            fsdp2.fully_shard(module, mesh=_mesh())
        model(x)

    def shared_param_across_groups() -> None:
        mesh = _mesh()
        model = Root()
        model.b.lin.weight = model.a.lin.weight
        fsdp2.fully_shard(model.a, mesh=mesh)
        fsdp2.fully_shard(model.b, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        # As in torch, the calls above are accepted and the first forward (lazy init)
        # raises; code that sets up the model before its first step sees no difference.
        model(x)

    def functional_call_with_full_tensors() -> None:
        model = _sharded_root()
        full = {name: torch.zeros(p.shape) for name, p in model.named_parameters()}
        torch.func.functional_call(model, full, (x,))

    def zero_dim_param() -> None:
        fsdp2.fully_shard(WithScalar(), mesh=_mesh())

    def sparse_embedding() -> None:
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        fsdp2.fully_shard(model, mesh=_mesh())

    def sparse_gradient() -> None:
        model = SparseLookup()
        fsdp2.fully_shard(model, mesh=_mesh())
        model(torch.tensor([[1, 2], [3, 4]])).sum().backward()

    def applied_twice() -> None:
        block = Block()
        fsdp2.fully_shard(block, mesh=_mesh())
        fsdp2.fully_shard(block, mesh=_mesh())

    def deepcopy_sharded() -> None:
        copy.deepcopy(_sharded_root())

    def mesh_not_a_device_mesh() -> None:
        fsdp2.fully_shard(Block(), mesh="cpu")  # type: ignore[arg-type]

    def mesh_3d() -> None:
        fsdp2.fully_shard(Block(), mesh=init_device_mesh("cpu", (1, 1, dist.get_world_size())))

    def dp_mesh_dims() -> None:
        fsdp2.fully_shard(Block(), mesh=_mesh(), dp_mesh_dims=object())  # type: ignore[call-arg]

    def dp_mesh_dims_plain_params() -> None:
        world = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
        dims = types.SimpleNamespace(shard="dp", replicate=None)
        fsdp2.fully_shard(Block(), mesh=world, dp_mesh_dims=dims)

    def dp_mesh_dims_sharded_on_dp() -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        block = Block()
        for name, param in list(block.lin.named_parameters()):
            placement = Shard(0) if name == "weight" else Replicate()
            dtensor = torch.nn.Parameter(distribute_tensor(param.detach(), world, [placement]))
            block.lin.register_parameter(name, dtensor)
        dims = types.SimpleNamespace(shard="dp", replicate=None)
        fsdp2.fully_shard(block, mesh=world, dp_mesh_dims=dims)

    def dp_mesh_dims_other_mesh() -> None:
        from torch.distributed.tensor import distribute_module

        block = distribute_module(Block(), init_device_mesh("cpu", (dist.get_world_size(),)))
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        dims = types.SimpleNamespace(shard="dp", replicate=None)
        fsdp2.fully_shard(block, mesh=world, dp_mesh_dims=dims)

    def dp_mesh_dims_unknown_name() -> None:
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        dims = types.SimpleNamespace(shard="fsdp", replicate=None)
        fsdp2.fully_shard(Block(), mesh=world, dp_mesh_dims=dims)

    def dp_mesh_dims_nothing_named() -> None:
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        dims = types.SimpleNamespace(shard=None, replicate=None)
        fsdp2.fully_shard(Block(), mesh=world, dp_mesh_dims=dims)

    def dp_mesh_dims_reshard_int() -> None:
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        dims = types.SimpleNamespace(shard="dp", replicate=None)
        fsdp2.fully_shard(Block(), mesh=world, dp_mesh_dims=dims, reshard_after_forward=2)

    def reshard_int_not_divisor() -> None:
        fsdp2.fully_shard(Block(), mesh=_mesh(), reshard_after_forward=3)

    def placement_not_shard() -> None:
        fsdp2.fully_shard(Block(), mesh=_mesh(), shard_placement_fn=lambda p: Replicate())

    def placement_result_without_a_mesh() -> None:
        from types import SimpleNamespace

        result = SimpleNamespace(placement=Shard(0), mesh_info="dp")
        fsdp2.fully_shard(Block(), mesh=_mesh(), shard_placement_fn=lambda p: result)

    def placement_dim_out_of_range() -> None:
        fsdp2.fully_shard(Block(), mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.dim()))

    def placement_uneven_dim() -> None:
        model = nn.Linear(3, 4)  # weight (4, 3): dim 1 of size 3 over 2 ranks
        fsdp2.fully_shard(model, mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.dim() - 1))

    def ignored_not_a_parameter() -> None:
        fsdp2.fully_shard(Block(), mesh=_mesh(), ignored_params={torch.ones(2)})

    def set_reshard_after_forward_not_bool() -> None:
        _sharded_root().set_reshard_after_forward(2)  # type: ignore[arg-type]

    def divide_factor_not_positive() -> None:
        _sharded_root().set_gradient_divide_factor(0)

    def all_reduce_hook_not_callable() -> None:
        _sharded_root().set_all_reduce_hook("sum")  # type: ignore[arg-type]

    def max_input_buffers_zero() -> None:
        _sharded_root().set_reduce_scatter_max_input_buffers(0)

    def max_input_buffers_bool() -> None:
        _sharded_root().set_reduce_scatter_max_input_buffers(True)

    def prefetch_unsharded_module() -> None:
        _sharded_root().set_modules_to_forward_prefetch([nn.Linear(2, 2)])  # type: ignore[list-item]

    def share_comm_ctx_after_forward() -> None:
        model = _sharded_root()
        model(x)
        fsdp2.share_comm_ctx([model.a, model.b])

    def register_method_not_sharded() -> None:
        fsdp2.register_fsdp_forward_method(Block(), "generate")

    def register_method_missing() -> None:
        fsdp2.register_fsdp_forward_method(_sharded_root().a, "sample")

    def custom_all_gather() -> None:
        _sharded_root().set_custom_all_gather(object())

    def custom_reduce_scatter() -> None:
        _sharded_root().set_custom_reduce_scatter(object())

    def separate_reduce_scatter_group_not_bool() -> None:
        _sharded_root().set_separate_reduce_scatter_group(1)  # type: ignore[arg-type]

    def symm_mem_for_comm() -> None:
        _sharded_root().set_symm_mem_for_comm()

    def process_group_allocated_buffers_not_bool() -> None:
        _sharded_root().a.set_allocate_memory_from_process_group_for_comm(1)  # type: ignore[arg-type]

    def process_group_allocated_buffers_with_custom_comm() -> None:
        class Comm:
            def allocate(self, *args: object, **kwargs: object) -> None:
                raise AssertionError("must not be called")

            def __call__(self, *args: object, **kwargs: object) -> None:
                raise AssertionError("must not be called")

        block = _sharded_root().a
        block.set_custom_all_gather(Comm())
        block.set_allocate_memory_from_process_group_for_comm(True)

    def all_gather_extension() -> None:
        class Extended(torch.Tensor):  # half of torch FSDP2's all-gather extension hooks
            def fsdp_pre_all_gather(self, *args: object) -> None:
                raise AssertionError("must not be called")

        block = Block()
        block.lin.weight = nn.Parameter(block.lin.weight.detach().as_subclass(Extended))
        fsdp2.fully_shard(block, mesh=_mesh())

    def unused_params_not_bool() -> None:
        _sharded_root().set_reduce_scatter_unused_params(1)  # type: ignore[arg-type]

    def tp_mesh_outside_dp_parent() -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        block = Block()
        parallelize_module(block, _mesh(), {"lin": ColwiseParallel()})  # its own 1-D mesh
        fsdp2.fully_shard(block, mesh=_mesh())

    def tp_meshes_overlap() -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        world = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        block = Block()
        parallelize_module(block, world["dp"], {"lin": ColwiseParallel()})  # TP on dp's ranks
        fsdp2.fully_shard(block, mesh=world["dp"])

    def plain_tensor_grad_on_sharded_param() -> None:
        model = _sharded_root()
        model.a.lin.weight.grad = torch.zeros(4, 4)  # torch accepts it on a DTensor parameter
        model(x).sum().backward()

    def optimizer_created_before_fully_shard() -> None:
        model = Root()
        optimizer = torch.optim.AdamW(model.parameters())  # holds the originals
        for module in (model.a, model.b, model):
            fsdp2.fully_shard(module, mesh=_mesh())
        model(x).sum().backward()
        optimizer.step()  # would change nothing the model uses

    def optimizer_from_gathered_parameters() -> None:
        model = Root()
        fsdp2.fully_shard(model.a, mesh=_mesh())
        fsdp2.fully_shard(model.b, mesh=_mesh(), reshard_after_forward=False)
        fsdp2.fully_shard(model, mesh=_mesh())
        with torch.no_grad():
            model(x)  # leaves b's group gathered (as the root's would be by default)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # b's unsharded ones
        model(x).sum().backward()
        optimizer.step()  # would leave b's parameters unchanged

    def replaced_params_added_to_optimizer_later() -> None:
        model = Root()
        originals = list(model.b.parameters())
        for module in (model.a, model.b, model):
            fsdp2.fully_shard(module, mesh=_mesh())
        optimizer = torch.optim.SGD(model.a.parameters(), lr=0.1)
        model(x).sum().backward()
        optimizer.step()  # checked once: fine
        optimizer.add_param_group({"params": originals})
        optimizer.step()  # a new group: checked again

    return {
        name: fn
        for name, fn in locals().items()
        if callable(fn) and not name.startswith("_") and name != "x"
    }


def provoke_all() -> dict[str, tuple[str, str]]:
    """Rank function: run every case, record what it raised (or that it did not)."""
    torch.manual_seed(0)
    results: dict[str, tuple[str, str]] = {}
    for name, fn in _case_fns().items():
        try:
            fn()
        except Exception as error:  # the type is asserted by the test
            results[name] = (type(error).__name__, str(error))
        else:
            results[name] = ("no error", "")
    return results


# case -> (exception type, regex the message must match)
EXPECTED: dict[str, tuple[str, str]] = {
    "optimizer_created_before_fully_shard": (
        "RuntimeError",
        r"^fully_shard: AdamW holds 4 parameters that fully_shard replaced by sharded "
        r"DTensor parameters \('lin\.weight' \(Block\), 'lin\.bias' \(Block\), "
        r"'lin\.weight' \(Block\) and 1 more\)\. It was created before fully_shard.*"
        r"Create the optimizer after fully_shard",
    ),
    "functional_call_with_full_tensors": (
        "ValueError",
        r"^fully_shard: parameter '.*' was replaced by a Tensor of shape .*"
        r"torch\.func\.functional_call swaps in such tensors too: call it on a non-sharded "
        r"copy of the module\.$",
    ),
    "optimizer_from_gathered_parameters": (
        "RuntimeError",
        r"^fully_shard: SGD holds 2 unsharded parameters of sharded modules \('lin\.weight', "
        r"'lin\.bias'\)\. It was created from model\.parameters\(\) while their groups were "
        r"gathered.*call model\.reshard\(\) first\.$",
    ),
    "replaced_params_added_to_optimizer_later": (
        "RuntimeError",
        r"^fully_shard: SGD holds 2 parameters that fully_shard replaced",
    ),
    "forward_called_directly": (
        "RuntimeError",
        r"Block\.forward\(\) was called directly.*unshard\(\)",
    ),
    # torch lets DTensor's "got mixed torch.Tensor and DTensor" through, naming no module.
    "submodule_run_outside_its_group": (
        "RuntimeError",
        r"^fully_shard: FSDPPeeksIntoBlock\.forward\(\) ran 'a\.lin' \(Linear\) while the "
        r"parameters it uses were sharded: they belong to the group of a \(Block\), .*only "
        r"around that module's own forward.*also apply fully_shard to 'a\.lin'",
    ),
    "submodule_run_by_a_sibling": (
        "RuntimeError",
        r"^fully_shard: FSDPBorrower\.forward\(\) ran 'a\.lin' \(Linear\) while the "
        r"parameters it uses were sharded: they belong to the group of a \(Block\)",
    ),
    "unregistered_method": (
        "RuntimeError",
        r"FSDPBlock\.generate\(\) computed on sharded parameters.*register_fsdp_forward_method"
        r"\(module, 'generate'\).*unshard\(\)",
    ),
    # Where torch's FSDP raises the same error, its wording leads the message (torch's own
    # tests match it), followed by fsdp2's explanation.
    "first_forward_not_through_root": (
        "RuntimeError",
        r"^FSDP state has already been lazily initialized for a\nFSDP requires running "
        r"forward through the root module first.*outermost sharded module",
    ),
    "meta_params_at_first_forward": (
        "RuntimeError",
        r"^FSDP parameters should be materialized from meta device before training, but the "
        r"following were still on meta device: \['a\.lin\.weight', 'a\.lin\.bias'\]\n"
        r".*to_empty",
    ),
    "shared_param_across_groups": (
        "ValueError",
        r"on Block: parameter 'lin\.weight' is already managed by another fully_shard group "
        r"\(the call on Block\)",
    ),
    "zero_dim_param": (
        "ValueError",
        r"doesn't support scalar parameters\. Change temperature to a 1D tensor with numel "
        r"equal to 1.*ignored_params",
    ),
    "sparse_embedding": (
        "ValueError",
        r"^fully_shard: parameter '0\.weight' belongs to Embedding\(sparse=True\), whose sparse "
        r"gradients fully_shard cannot reduce-scatter\. Build it with sparse=False.*ignored_params",
    ),
    "sparse_gradient": (
        "RuntimeError",
        r"^fully_shard: parameter 'table' of the root \(SparseLookup\) got a gradient with "
        r"layout torch\.sparse_coo; fully_shard reduce-scatters dense \(strided\) gradients "
        r"only\..*ignored_params",
    ),
    "applied_twice": ("AlreadyShardedError", r"already applied to this FSDPBlock"),
    "deepcopy_sharded": (
        "DeepcopyUnsupportedError",
        r"copy\.deepcopy of a sharded FSDPRoot.*before fully_shard",
    ),
    "mesh_not_a_device_mesh": ("TypeError", r"expects a DeviceMesh, got str"),
    "mesh_3d": ("ValueError", r"^fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"),
    "dp_mesh_dims": ("TypeError", r"dp_mesh_dims=.*expects a DataParallelMeshDims"),
    "dp_mesh_dims_plain_params": (
        "ValueError",
        r"all parameters must be DTensors.*plain tensor for parameter 'lin\.weight'",
    ),
    "dp_mesh_dims_sharded_on_dp": (
        "ValueError",
        r"'lin\.weight': Expected Replicate\(\) on DP shard dim 'dp' \(index 0\) but got S\(0\)",
    ),
    "dp_mesh_dims_other_mesh": ("ValueError", r"'lin\.weight' is a DTensor on .*same mesh"),
    "dp_mesh_dims_unknown_name": (
        "ValueError",
        r"Mesh dim name 'fsdp' not found in mesh\.mesh_dim_names \('dp',\)",
    ),
    "dp_mesh_dims_nothing_named": ("ValueError", r"At least one of shard or replicate"),
    "dp_mesh_dims_reshard_int": ("NotImplementedError", r"reshard_after_forward as int"),
    "reshard_int_not_divisor": (
        "ValueError",
        r"reshard_after_forward=3.*divisor of the shard group",
    ),
    "placement_not_shard": (
        "TypeError",
        r"shard_placement_fn returned Replicate\(\) for 'lin\.weight'",
    ),
    "placement_result_without_a_mesh": (
        "TypeError",
        r"returned a mesh_info of type str for 'lin\.weight'.*FSDPMeshInfo",
    ),
    "placement_dim_out_of_range": (
        "InvalidShardDimError",  # a ValueError and, as torch raises, an AssertionError
        r"^Shard dim 2 is invalid for 2D tensor: torch\.Size\(\[4, 4\]\)"
        r".*Shard\(2\) for 'lin\.weight'.*must be in",
    ),
    "placement_uneven_dim": (
        "UnevenShardError",  # a ValueError and, as torch raises, a NotImplementedError
        r"^FSDP does not support uneven sharding on dim 1.*Shard\(1\) for 'weight' of shape "
        r"\(4, 3\).*divisible",
    ),
    "ignored_not_a_parameter": ("TypeError", r"ignored_params.*nn\.Parameter.*got Tensor"),
    "set_reshard_after_forward_not_bool": (
        "ValueError",
        r"set_reshard_after_forward expects a bool",
    ),
    "divide_factor_not_positive": ("ValueError", r"positive number, got 0"),
    "all_reduce_hook_not_callable": ("ValueError", r"expects a callable, got 'sum'"),
    "max_input_buffers_zero": ("ValueError", r"int >= 1, got 0"),
    "max_input_buffers_bool": ("TypeError", r"int >= 1, got bool True"),
    "prefetch_unsharded_module": ("ValueError", r"set_modules_to_forward_prefetch.*got Linear"),
    "share_comm_ctx_after_forward": ("RuntimeError", r"already ran its first forward"),
    "register_method_not_sharded": ("ValueError", r"module fully_shard was applied to, got Block"),
    "register_method_missing": ("ValueError", r"FSDPBlock has no method named 'sample'"),
    "custom_all_gather": (
        "TypeError",
        r"FSDPRoot\.set_custom_all_gather expects a communication object with an allocate",
    ),
    "custom_reduce_scatter": (
        "TypeError",
        r"FSDPRoot\.set_custom_reduce_scatter expects.*got object",
    ),
    "separate_reduce_scatter_group_not_bool": (
        "ValueError",
        r"set_separate_reduce_scatter_group expects a bool, got 1",
    ),
    "symm_mem_for_comm": ("NotImplementedError", r"symmetric-memory.*set_custom_all_gather"),
    "process_group_allocated_buffers_not_bool": (
        "TypeError",
        r"FSDPBlock\.set_allocate_memory_from_process_group_for_comm expects a bool, got 1",
    ),
    "process_group_allocated_buffers_with_custom_comm": (
        "CustomCommConflictError",
        r"set_allocate_memory_from_process_group_for_comm: this module has a custom all-gather",
    ),
    "all_gather_extension": (
        "TypeError",
        r"parameter 'lin\.weight' \(Extended\) defines only one of fsdp_pre_all_gather/"
        r"fsdp_post_all_gather; define fsdp_post_all_gather too",
    ),
    "tp_mesh_outside_dp_parent": (
        "ValueError",
        r"'lin\.weight' is a DTensor on .*needs both to be named slices of one mesh",
    ),
    "tp_meshes_overlap": ("ValueError", r"'lin\.weight' is a DTensor on .*does not combine with"),
    "plain_tensor_grad_on_sharded_param": (
        "RuntimeError",
        r"parameter 'lin\.weight' has a Tensor gradient.*None or a DTensor",
    ),
    "unused_params_not_bool": ("ValueError", r"set_reduce_scatter_unused_params expects a bool"),
}


@pytest.fixture(scope="module")
def provoked() -> dict[str, tuple[str, str]]:
    return run_ranks(provoke_all, 2)[0]


def test_every_case_is_expected(provoked: dict[str, tuple[str, str]]) -> None:
    assert sorted(provoked) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_error_message(provoked: dict[str, tuple[str, str]], case: str) -> None:
    kind, pattern = EXPECTED[case]
    got_kind, message = provoked[case]
    assert got_kind == kind, f"{case}: expected {kind}, got {got_kind}: {message}"
    assert re.search(pattern, message, flags=re.DOTALL), message


def test_tensor_parallel_mesh_of_another_device_type() -> None:
    """A TP DTensor on a CPU mesh under a CUDA data-parallel mesh: torch's ValueError and
    wording (checked on stand-in meshes: a CPU-only build cannot make a CUDA mesh)."""
    from fsdp2._param import _spmd_mesh

    dp_mesh = types.SimpleNamespace(device_type="cuda")
    tp_mesh = types.SimpleNamespace(device_type="cpu")
    with pytest.raises(
        ValueError,
        match=r"^Requires DTensor to have mesh of the same type as "
        r"the FSDP mesh but got cpu for DTensor and cuda for FSDP.*'lin\.weight'",
    ):
        _spmd_mesh(dp_mesh, tp_mesh, "lin.weight")  # type: ignore[arg-type]


def test_torch_exception_classes() -> None:
    """Errors torch raises as AssertionError / NotImplementedError are caught as such."""
    assert issubclass(fsdp2._init.InvalidShardDimError, (ValueError, AssertionError))
    assert issubclass(fsdp2._init.InvalidShardDimError, AssertionError)
    assert issubclass(fsdp2._param.UnevenShardError, ValueError)
    assert issubclass(fsdp2._param.UnevenShardError, NotImplementedError)


def accepts_torch_policies() -> list[str]:
    """Users who switch by import may keep building policies from torch."""
    from torch.distributed import fsdp as torch_fsdp

    model = Block()
    fsdp2.fully_shard(
        model,
        mesh=_mesh(),
        mp_policy=torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.float64),
        offload_policy=torch_fsdp.OffloadPolicy(),
    )
    out = model(torch.randn(2, 4, dtype=torch.float64))
    return [str(out.dtype), str(model._fsdp_state.group.param_dtype)]


def test_torch_policy_objects_are_accepted() -> None:
    assert run_ranks(accepts_torch_policies, 2)[0] == ["torch.float64", "torch.float64"]


class _Stack(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, w) for w in widths)
        self.head = nn.Linear(widths[-1], 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[..., :8]
        return self.head(x)


def ranks_build_different_models(case: str) -> str:
    """Rank 1 (``case``: ranks 2 and 3 of an HSDP mesh) builds another model than the
    others; returns the message every rank raises at the first forward."""
    hsdp = case == "hsdp_replicas"
    odd = dist.get_rank() >= 2 if hsdp else dist.get_rank() == 1
    widths = [8, 8, 8]
    if odd and case in ("sizes", "hsdp_replicas"):
        widths = [8, 9, 8]
    if odd and case == "groups":
        widths = [8, 8, 8, 8]
    torch.manual_seed(0)
    model = _Stack(widths)
    if odd and case == "frozen":
        model.layers[1].bias.requires_grad_(False)
    mesh = init_device_mesh("cpu", (2, 2) if hsdp else (2,))
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("sizes", r"in layers\.1 \(Linear\) \(group 3 of 4 on it\): rank {me} has 'weight' "
                  r"\[{mine}, 8\] float32; 'bias' \[{mine}\] float32; rank {other} has "
                  r"'weight' \[{theirs}, 8\] float32; 'bias' \[{theirs}\] float32\."),
        ("groups", r"rank {me} has {n_mine} fully_shard groups on it, rank {other} has "
                   r"{n_theirs} \(this rank's: the root \(_Stack\), layers\.0 \(Linear\)"),
        ("frozen", r"in layers\.1 \(Linear\).*rank {me} has 'weight' \[8, 8\] float32; "
                   r"'bias' \[8\] float32{f_mine}; rank {other} has 'weight' \[8, 8\] "
                   r"float32; 'bias' \[8\] float32{f_theirs}\."),
        ("hsdp_replicas", r"in layers\.1 \(Linear\).*rank {me} has 'weight' \[{mine}, 8\].*"
                          r"rank {other} has 'weight' \[{theirs}, 8\]"),
    ],
)  # fmt: skip
def test_ranks_that_built_different_models_all_raise(case: str, pattern: str) -> None:
    """A rank whose model differs (sizes, a layer more, a parameter frozen on one rank) made
    gloo abort the process from its own thread (NCCL: a hang); every rank now raises at the
    first forward, naming the group, both ranks and what each holds."""
    hsdp = case == "hsdp_replicas"
    messages = run_ranks(ranks_build_different_models, 4 if hsdp else 2, case)
    for rank, message in enumerate(messages):
        odd = rank >= 2 if hsdp else rank == 1
        other = (rank + 2) % 4 if hsdp else 1 - rank
        values = {
            "me": rank, "other": other, "mine": 9 if odd else 8, "theirs": 8 if odd else 9,
            "n_mine": 5 if odd else 4, "n_theirs": 4 if odd else 5,
            "f_mine": ", frozen" if odd else "", "f_theirs": "" if odd else ", frozen",
        }  # fmt: skip
        assert message.startswith("fully_shard: the ranks of one process group shard"), message
        assert re.search(pattern.format(**values), message), message
        assert "Every rank of a mesh must build the same model" in message
