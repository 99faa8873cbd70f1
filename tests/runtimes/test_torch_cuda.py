"""A language model's parts on a GPU (runtimes/torch_cuda.py): the torch runtime is offered for
a GPU's stateful parts only, says why it cannot run where CUDA is missing, puts a part's
tensors on its device once for all its buckets, keeps each sequence's state in a pool on that
device, and gives back host outputs. What needs no CUDA runs here (the device code path on
the host's own device, the copies on torch's meta device); tests/gpu/check_lm.py runs it on a
GPU, and the test at the end where there is one."""

from __future__ import annotations

import lm_models
import pytest
import torch
from test_torch_lowered import greedy, one_part

from partitioner.profile import DeviceProfile
from runtimes import registry, state, torch_cuda
from runtimes.torch_eager import (
    INITIAL,
    TorchExecutable,
    TorchRuntime,
    prepared,
    remember_initial,
)

GPU = DeviceProfile(id="gpu1", kind="gpu", runtimes=["triton"])
CPU = DeviceProfile(id="cpu0", kind="cpu")
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def part() -> torch.fx.GraphModule:
    module = one_part(lm_models.export(lm_models.lm("llama")))
    remember_initial(module)  # (as a build does: cuvild/workers/build.py)
    return module


def test_the_torch_runtime_serves_a_gpus_stateful_parts_alone() -> None:
    assert registry.candidates_for(GPU, "fp32", "auto") == ["triton"]
    assert registry.candidates_for(GPU, "fp32", "auto", stateful=True) == ["triton", "torch"]
    assert registry.candidates_for(CPU, "fp32", "auto", stateful=True) == \
        registry.candidates_for(CPU, "fp32", "auto")
    assert torch_cuda.target(GPU) == torch.device("cuda", 1)
    assert torch_cuda.target(CPU) is None
    emulated = DeviceProfile(id="gpu0", kind="gpu", emulated=True)
    assert torch_cuda.target(emulated) is None and TorchRuntime().can_target(emulated, "fp32")


def test_a_language_model_is_planned_only_where_a_runtime_may_keep_its_state() -> None:
    """An emulated NPU's profile lists the runtimes it measured (OpenVINO); its stateful parts
    run on torch on the host. The planner's support data says a node that updates the cache
    runs there only where engine.runtimes lets torch build (else it planned a model there
    that the build then refused: "only torch keeps them per sequence ... tried for:
    ['openvino']", the model READY and every generation failing)."""
    from partitioner.fxgraph import build_costgraph

    npu = DeviceProfile(id="npu0", kind="npu", emulated=True, runtimes=["openvino"])
    assert "torch" in registry.candidates_for(npu, "fp32", "auto", stateful=True)
    assert "torch" not in registry.candidates_for(npu, "fp32", "auto")
    graph = build_costgraph(lm_models.export(lm_models.lm("llama")))
    writes = [n for n in graph.nodes if n.updates_state]
    assert writes
    allowed = registry.support([npu], {"npu": ["openvino", "torch"]})["npu0"]
    refused = registry.support([npu], {"npu": ["openvino"]})["npu0"]
    assert all(allowed(n) for n in writes) and not any(refused(n) for n in writes)


@pytest.mark.skipif(CUDA, reason="this host has CUDA: nothing is missing to report")
def test_without_cuda_the_runtime_says_why_it_cannot_run_on_a_gpu(part) -> None:
    runtime = TorchRuntime()
    assert not runtime.can_target(GPU, "fp32")
    assert runtime.why_not(GPU, "fp32") == \
        "cannot run on gpu1: no CUDA device (torch.cuda.is_available() is False)"
    assert runtime.why_not(GPU, "int4") == "cannot target gpu at int4"


def test_a_parts_tensors_go_to_its_device_once_for_all_its_buckets(part) -> None:
    meta = torch.device("meta")  # (a device without CUDA: shapes, no data)
    module = prepared(part, None, host=False)
    first, second = (torch_cuda.on_device(module, meta, INITIAL) for _ in range(2))
    attrs = [{str(n.target): getattr(m, str(n.target)) for n in m.graph.nodes
              if n.op == "get_attr"} for m in (first, second)]
    assert attrs[0] and all(t.device == meta for t in attrs[0].values())
    assert all(attrs[0][k] is attrs[1][k] for k in attrs[0])  # one copy, shared
    assert all(t.device == meta for t in first.meta[INITIAL].values())
    assert torch_cuda.on_device(module, None, INITIAL) is module
    assert not any("packed" in k for k in attrs[0])  # nothing packed for the host's oneDNN
    # a sequence's state is a row of a pool on the device
    held = state.pool("on-meta", first.meta[INITIAL])
    try:
        held.row(7)
        assert all(t.device == meta and t.shape[0] == 1 for t in held.tensors.values())
    finally:
        state.drop_scope("on-meta")


def test_the_device_path_generates_as_the_host_path(part) -> None:
    """The executable of a part given a device (here the host's own: the copies in and out,
    the device's tensors and pool, as on a GPU) generates what the host's does."""
    host = torch.device("cpu")
    on = TorchExecutable(torch_cuda.on_device(prepared(part, None, host=False), host, INITIAL),
                         None, host)
    alone = TorchExecutable(part, None)
    assert not on.batches  # (sequences on a device run one by one: not yet batched there)
    try:
        assert greedy(on, [1, 5, 9], 8, 1) == greedy(alone, [1, 5, 9], 8, 1)
    finally:
        state.drop_scope("lm")


@pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_language_model_generates_on_the_gpu_as_on_the_host(part, precision: str) -> None:
    from runtimes.base import CompileSpec

    gpu = DeviceProfile(id="gpu0", kind="gpu")
    spec = CompileSpec(device=gpu, precision=precision,
                       example_inputs=[torch.tensor([0]), torch.tensor([[1]])])
    exe = TorchRuntime().compile(part, spec)
    assert exe.device == torch.device("cuda", 0)
    try:
        got = greedy(exe, [1, 5, 9], 8, 1)
        exe.use(2, "lm")
        (logits,) = exe.run([torch.tensor([0]), torch.tensor([[1]])])
        assert logits.device.type == "cpu" and logits.dtype == torch.float32
    finally:
        state.drop_scope("lm")
    if precision == "fp32":
        try:
            assert got == greedy(TorchExecutable(part, None), [1, 5, 9], 8, 1)
        finally:
            state.drop_scope("lm")
