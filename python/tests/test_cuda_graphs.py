"""CUDA graphs survive updates, with PyTorch on a GPU: a graph captured
once reads a param by address, so an update must land at that address and
a replay must see it without recapture.

- library-owned device param (`Manager.allocate(..., device=0)`, CUDA VMM
  memory viewed through `__cuda_array_interface__`): capture, clear (the
  GPU memory is given back, the address kept), update, replay;
- engine-owned param (a module's CUDA parameter, `register_module`):
  capture, update in place, replay.

Skipped, saying why, where PyTorch sees no GPU (CI); `scripts/gpu.sh` runs
it on the GPU machine."""

import numpy as np
import pytest

from weight_manager import Manager

torch = pytest.importorskip("torch", reason="torch is not installed in this Python")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no GPU here", allow_module_level=True)
safetensors_torch = pytest.importorskip("safetensors.torch")

SHAPE = (512, 512)


def snapshot(path, version: str, tensors: dict):
    path.mkdir()
    safetensors_torch.save_file(tensors, str(path / "model_state.tp0.0.safetensors"))
    (path / "version.yaml").write_text(f"step: {version}\n")
    return path


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g, dtype=torch.float32)


def capture(fn):
    """A CUDA graph of fn(), captured on a side stream after a warm-up
    (PyTorch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def check_replay(graph, out, x, w_host):
    """Replay and compare with the same arithmetic on the expected weights:
    an elementwise kernel (bit for bit) and a matrix product (to rounding)."""
    graph.replay()
    torch.cuda.synchronize()
    w = w_host.cuda()
    assert torch.equal(out[0], w * 2.0 + x), "the elementwise kernel read other weights"
    torch.testing.assert_close(out[1], x @ w)


def kernels(w, x):
    out = (torch.empty(SHAPE, device="cuda"), torch.empty(SHAPE, device="cuda"))

    def run():
        out[0].copy_(w * 2.0 + x)
        out[1].copy_(x @ w)

    return out, run


def test_library_owned_param_graph_survives_clear_and_update(tmp_path):
    v1, v2 = weights(1), weights(2)
    d1 = snapshot(tmp_path / "v1", "1", {"w": v1})
    d2 = snapshot(tmp_path / "v2", "2", {"w": v2})
    with Manager(device=0) as m:
        a = m.allocate("w", "f32", SHAPE, device=0)
        m.update(str(d1))
        w = torch.as_tensor(a, device="cuda")
        assert w.data_ptr() == a.ptr
        x = torch.randn(SHAPE, device="cuda")
        out, run = kernels(w, x)
        graph = capture(run)
        check_replay(graph, out, x, v1)

        free_before = torch.cuda.mem_get_info()[0]
        m.clear()
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed >= w.numel() * 4, f"clear gave back {freed} bytes of the GPU's memory"
        m.update(str(d2))
        assert torch.as_tensor(a, device="cuda").data_ptr() == w.data_ptr()
        check_replay(graph, out, x, v2)


def test_engine_owned_param_graph_survives_an_in_place_update(tmp_path):
    v1, v2 = weights(3), weights(4)
    d1 = snapshot(tmp_path / "v1", "1", {"weight": v1})
    d2 = snapshot(tmp_path / "v2", "2", {"weight": v2})
    module = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False).cuda()
    with Manager(device=0) as m:
        m.register_module(module)
        m.update(str(d1), in_place=True)
        w = module.weight.detach()
        ptr = w.data_ptr()
        x = torch.randn(SHAPE, device="cuda")
        with torch.no_grad():
            out, run = kernels(w, x)
            graph = capture(run)
        check_replay(graph, out, x, v1)
        m.update(str(d2), in_place=True)
        assert module.weight.data_ptr() == ptr
        check_replay(graph, out, x, v2)
        assert np.array_equal(module.weight.detach().cpu().numpy(), v2.numpy())
