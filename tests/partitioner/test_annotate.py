"""Tests for partitioner.annotate: where ``@partition`` annotations land, and what keeps them."""

import copy
import io
import pickle

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from partitioner.annotate import ANNOTATION_KEY, annotations, export, partition

NPU_FP16 = {"device": "npu", "precision": "fp16", "strict": True}
GPU = {"device": "gpu", "precision": None, "strict": True}
INT8_HINT = {"device": None, "precision": "int8", "strict": False}


@partition(device="npu", precision="fp16")
class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@partition(precision="int8", strict=False)
def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


class Net(nn.Module):
    """All three forms: a decorated class, an annotated instance, a decorated function."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBlock()
        self.fc = partition(device="gpu")(nn.Linear(4, 4))
        self.w = nn.Parameter(torch.randn(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x).mean((2, 3))
        return project(self.fc(y), self.w) * 2


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8)


@pytest.fixture(scope="module")
def net_ep() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return export(Net().eval(), (_x(),))


def test_annotations_land_on_exactly_the_region_nodes(net_ep):
    assert annotations(net_ep) == {
        "conv2d": NPU_FP16,
        "relu": NPU_FP16,
        "linear": GPU,
        "matmul": INT8_HINT,
    }
    outside = {n.name: n for n in net_ep.graph.nodes if n.name not in annotations(net_ep)}
    assert {"mean", "mul", "x", "output", "p_fc_weight", "p_block_conv_weight"} <= set(outside)
    for node in outside.values():
        assert ANNOTATION_KEY not in (node.meta.get("custom") or {}), node.name


def test_annotations_are_copies(net_ep):
    annotations(net_ep)["conv2d"]["device"] = "cpu"
    assert annotations(net_ep)["conv2d"]["device"] == "npu"


def test_instance_form_annotates_in_place_and_keeps_names():
    plain, lin = nn.Linear(4, 2), nn.Linear(4, 2)
    assert partition(device="gpu")(lin) is lin
    assert list(lin.state_dict()) == list(plain.state_dict())
    ep = export(nn.Sequential(lin), (torch.randn(3, 4),))
    plain_ep = export(nn.Sequential(plain), (torch.randn(3, 4),))
    assert [n.name for n in ep.graph.nodes] == [n.name for n in plain_ep.graph.nodes]
    assert list(ep.state_dict) == list(plain_ep.state_dict)
    assert annotations(ep) == {"linear": GPU}
    assert annotations(plain_ep) == {}


def test_instance_form_keeps_forward_signature_for_dynamic_shapes():
    lin = partition(device="npu0")(nn.Linear(4, 2))
    batch = torch.export.Dim("batch")
    ep = export(lin, (torch.randn(3, 4),), dynamic_shapes={"input": {0: batch}})
    assert ep.graph_signature.user_inputs == ("input",)
    assert annotations(ep)["linear"]["device"] == "npu0"


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)).sigmoid()


def test_nested_inner_wins_and_inherits_unset_fields():
    inner = partition(precision="fp16")(nn.Linear(4, 4))
    model = partition(device="npu", precision="fp32", strict=False)(Outer(inner))
    got = annotations(export(model, (torch.randn(2, 4),)))
    outer = {"device": "npu", "precision": "fp32", "strict": False}
    assert got == {
        "linear": {"device": "npu", "precision": "fp16", "strict": False},
        "linear_1": outer,
        "sigmoid": outer,
    }


def test_nested_inner_device_overrides_outer():
    inner = partition(device="cpu", strict=True)(nn.Linear(4, 4))
    model = partition(device="gpu", strict=False)(Outer(inner))
    got = annotations(export(model, (torch.randn(2, 4),)))
    assert got["linear"] == {"device": "cpu", "precision": None, "strict": True}
    assert got["linear_1"] == {"device": "gpu", "precision": None, "strict": False}


def test_reannotating_merges_latest_wins():
    block = partition(device="cpu")(ConvBlock())  # instance of a decorated class
    assert annotations(export(block, (_x(),)))["conv2d"] == {**NPU_FP16, "device": "cpu"}
    partition(precision="bf16")(block)  # the same instance again
    want = {"device": "cpu", "precision": "bf16", "strict": True}
    assert annotations(export(block, (_x(),)))["conv2d"] == want

    @partition(strict=False)
    class Sub(ConvBlock):  # inherits the decorated forward
        pass

    assert annotations(export(Sub(), (_x(),)))["relu"] == {**NPU_FP16, "strict": False}


def test_save_load_round_trip_keeps_annotations(net_ep, tmp_path):
    buffer = io.BytesIO()
    torch.export.save(net_ep, buffer)
    buffer.seek(0)
    assert annotations(torch.export.load(buffer)) == annotations(net_ep)
    path = tmp_path / "net.pt2"
    torch.export.save(net_ep, path)
    assert annotations(torch.export.load(path)) == annotations(net_ep)


def test_run_decompositions_annotates_the_nodes_it_makes(net_ep):
    decomposed = net_ep.run_decompositions()
    by_target = {}
    for node in decomposed.graph.nodes:
        if node.op == "call_function":
            by_target[node.target] = annotations(decomposed).get(node.name)
    aten = torch.ops.aten
    assert by_target[aten.convolution.default] == NPU_FP16
    assert by_target[aten.relu.default] == NPU_FP16
    assert by_target[aten.addmm.default] == GPU  # linear -> permute + addmm
    assert by_target[aten.permute.default] == GPU
    assert by_target[aten.mean.dim] is None
    assert by_target[aten.mul.Tensor] is None


def test_plain_torch_export_under_preserve_node_meta():
    model, x = Outer(partition(device="npu")(nn.Linear(4, 4))), torch.randn(2, 4)
    with fx_traceback.preserve_node_meta():
        ep = torch.export.export(model, (x,))
    assert annotations(ep) == {"linear": {"device": "npu", "precision": None, "strict": True}}
    # Without it, torch's non-strict export drops node meta from the tracing context.
    assert annotations(torch.export.export(model, (x,))) == {}


def test_strict_export_keeps_annotations():
    model = Outer(partition(device="npu")(nn.Linear(4, 4)))
    got = annotations(export(model, (torch.randn(2, 4),), strict=True))
    assert got["linear"] == {"device": "npu", "precision": None, "strict": True}
    assert "linear_1" not in got and "sigmoid" not in got


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device": "tpu"}, "device"),
        ({"device": "gpu:1"}, "device"),
        ({"device": "GPU"}, "device"),
        ({"device": "gpu0\n"}, "device"),
        ({"device": 0}, "device"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "float16"}, "precision"),
        ({"strict": "yes"}, "strict"),
    ],
)
def test_bad_arguments_raise_at_decoration_time(kwargs, named):
    with pytest.raises(ValueError, match=named) as err:
        partition(**kwargs)
    if named == "device":
        assert "'cpu', 'gpu', 'npu'" in str(err.value)
    if named == "precision":
        assert "'fp32', 'bf16', 'fp16', 'int8'" in str(err.value)


@pytest.mark.parametrize("device", ["cpu", "gpu", "npu", "cpu0", "gpu1", "npu12", None])
def test_good_devices_accepted(device):
    lin = partition(device=device)(nn.Linear(4, 2))
    got = annotations(export(lin, (torch.randn(3, 4),)))
    assert got == {"linear": {"device": device, "precision": None, "strict": True}}


def test_eager_outputs_unchanged():
    torch.manual_seed(0)
    model = Net().eval()
    reference = copy.deepcopy(model)
    del vars(reference.fc)["forward"]  # back to nn.Linear's own forward
    x = _x()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model.block(x), torch.relu(model.block.conv(x)))
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    assert torch.equal(project(a, b), a @ b)
    assert project.__name__ == "project" and project.__doc__ is None


def test_eager_calls_leave_tracing_context_alone():
    seen = []

    @partition(device="npu")
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(dict(fx_traceback.get_current_meta()))
        return x + 1

    probe(torch.ones(1))
    assert seen == [{}]


def test_deepcopy_and_pickle_keep_instance_annotation():
    lin = partition(device="gpu")(nn.Linear(4, 2))
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert vars(clone)["forward"].args[0] is clone  # bound to the copy, not the original
        assert annotations(export(clone, (torch.randn(3, 4),))) == {"linear": GPU}


def test_partition_rejects_non_callables():
    with pytest.raises(TypeError):
        partition(device="cpu")(42)
