"""The ViT's attention kernel (attention_backend, tasks/attention.py): a named backend is the one
allowed while the forward runs, the backends give the same numbers, ``auto`` orders cuDNN's first
on Hopper in half precision only, and a backend without a kernel is refused in one line."""
import os

import pytest
import torch

from conftest import ROOT
from settings.errors import ConfigError
from settings.parse import build_config
from tasks import attention, make_task
from test_training import TINY_VIT, train

CPU = torch.device("cpu")
YAML = os.path.join(ROOT, "config", "ViT.yaml")


def tiny_task(**overrides):
    return make_task(build_config(YAML, "quickstart", {
        "img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2,
        **overrides}))


@pytest.mark.parametrize("name, flag", [("math", "math_sdp_enabled"),
                                        ("flash", "flash_sdp_enabled")])
def test_a_named_backend_is_the_only_one_allowed_in_the_forward(name, flag):
    context = tiny_task(attention_backend=name).forward_kernels(CPU, torch.float32)
    others = {"math_sdp_enabled", "flash_sdp_enabled", "mem_efficient_sdp_enabled"} - {flag}
    with context():
        assert getattr(torch.backends.cuda, flag)()
        assert not any(getattr(torch.backends.cuda, f)() for f in others)
    assert all(getattr(torch.backends.cuda, f)() for f in others | {flag})  # restored after


def test_backends_compute_the_same_forward_and_gradients():
    task = tiny_task()
    torch.manual_seed(0)
    model = task.build_model()
    x = torch.randn(3, 20, 16, 32)
    results = []
    for name in ("math", "flash"):
        model.zero_grad()
        with tiny_task(attention_backend=name).forward_kernels(CPU, torch.float32)():
            out = model(x)
        out.square().mean().backward()
        results.append((out.detach(), model.blocks[0].attn.qkv.weight.grad.clone()))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-7)


def test_auto_orders_cudnn_first_on_hopper_in_half_precision_only(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "_CAN_ORDER", True)
    for capability, dtype, expected in [((9, 0), torch.bfloat16, attention.HOPPER_ORDER),
                                        ((9, 0), torch.float16, attention.HOPPER_ORDER),
                                        ((9, 0), torch.float32, None),
                                        ((8, 0), torch.bfloat16, None)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert attention.auto_order(cuda, dtype) == expected, (capability, dtype)
    assert attention.HOPPER_ORDER[0] == "cudnn"
    assert attention.auto_order(CPU, torch.bfloat16) is None  # torch's own choice on a CPU
    monkeypatch.setattr(attention, "_CAN_ORDER", False)  # a torch that cannot set the priority
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    assert attention.auto_order(cuda, torch.bfloat16) is None


def test_a_backend_without_a_kernel_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"attention_backend=cudnn has no kernel for float32 "
                                          r"attention with heads of 16 on cpu .*use "
                                          r"--attention_backend auto"):
        tiny_task(attention_backend="cudnn").forward_kernels(CPU, torch.float32)


def test_train_py_refuses_it_in_one_line_and_leaves_no_run(tmp_path):
    exp = str(tmp_path / "logs")
    r = train(TINY_VIT + ["--data_loader_config", "synthetic", "--num_iters", "2",
                          "--expdir", exp, "--attention_backend", "cudnn"], check=False)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "attention_backend=cudnn" in errors[0] and "auto" in errors[0]
    assert "Traceback" not in r.stderr
    runs = [f for _, _, files in os.walk(exp) for f in files if f.endswith(".pt")]
    assert runs == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_this_gpu_runs_and_matches_the_math_kernel():
    cuda = torch.device("cuda")
    task = tiny_task(embed_dim=96, num_heads=2)  # heads of 48, as the tutorial's
    torch.manual_seed(0)
    model = task.build_model().to(cuda)
    x = torch.randn(4, 20, 16, 32, device=cuda)
    outs = []
    for name in ("auto", "math"):
        context = tiny_task(embed_dim=96, num_heads=2, attention_backend=name).forward_kernels(
            cuda, torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16), context():
            outs.append(model(x).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    major = torch.cuda.get_device_capability()[0]
    assert (attention.auto_order(cuda, torch.bfloat16) == attention.HOPPER_ORDER) == (
        major == 9 and attention._CAN_ORDER)
