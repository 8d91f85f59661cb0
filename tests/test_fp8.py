"""fp8 linear layers (--fp8_linears, torchao's float8 training) on the CPU, where torchao
emulates them: the operands rounded to fp8 with the scales a GPU uses, multiplied in fp32.

Tolerances, from the formats' precision: e4m3 (inputs and weights) keeps 3 mantissa bits, a
unit roundoff of 2^-4 = 6.25%; e5m2 (tensorwise output gradients) 2 bits, 2^-3. One converted
linear's output differs from fp32 by rounding errors of both operands that partly cancel over
the dot product: norm-wise below 2^-4 (measured 3.6% tensorwise and rowwise, against bf16's
0.28%), its input and weight gradients below 2^-3 (measured at most 4.6%). In the tiny ViT the
blocks' fp8 outputs enter a residual stream and an unconverted head: its output within 2^-6
of fp32 (measured 0.35%; bf16: 0.40%), its whole gradient within 2^-5 (measured 0.5-0.7%), a
loss curve of 6 Adam steps within 1e-3 relative (measured 6e-5). Through the engine (global
batch 8, bf16 autocast) an fp8 run's losses follow the bf16 run's to 2e-3 (measured 1.3e-4).
Runs on 2 ranks scale their own operands: FSDP's bf16-gathered weights (losses averaged over
the ranks within 2e-3 of the serial fp8 run's, measured 3e-4; gradient norms 5e-3, measured
1.1e-3) and tp's slices (losses 1e-2, measured 3.2e-3; norms 2e-2, measured 5e-3). A resumed
run is bitwise the uninterrupted one.
"""
import copy
import json
import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import preloaded
from conftest import ROOT
from distributed_harness import run_ranks
from engine import checkpoint, fp8_linears
from engine.runtime import setup_runtime
from networks.vit import ViT
from settings.errors import ConfigError
from settings.parse import build_config
from test_ddp import Recording, vit_cfg, write_data

CPU = torch.device("cpu")
E4M3_U, E5M2_U = 2.0 ** -4, 2.0 ** -3
FP8 = dict(amp_mode="bf16", fp8_linears="tensorwise")


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def tiny_vit(seed=0, embed_dim=64):
    torch.manual_seed(seed)
    return ViT(img_size=(16, 32), patch_size=4, in_chans=20, out_chans=20, embed_dim=embed_dim,
               depth=2, num_heads=4)


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("recipe", fp8_linears.RECIPES)
def test_one_fp8_linear_is_as_close_as_e4m3_allows(recipe):
    torch.manual_seed(1)
    ref = nn.Linear(64, 256)
    x = torch.randn(128, 64, requires_grad=True)
    y_ref = ref(x)
    y_ref.square().sum().backward()
    grads_ref = x.grad.clone(), ref.weight.grad.clone()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y_bf16 = ref(x)
    conv = nn.Sequential(copy.deepcopy(ref))
    conv[0].weight.grad = x.grad = None
    assert fp8_linears.convert([conv], recipe, CPU) == 1
    y = conv(x)
    y.square().sum().backward()
    err = rel(y, y_ref)
    assert err < E4M3_U, err
    assert err > 4 * rel(y_bf16, y_ref), "the fp8 rounding did not happen"
    assert rel(x.grad, grads_ref[0]) < E5M2_U and rel(conv[0].weight.grad, grads_ref[1]) < E5M2_U


@pytest.mark.parametrize("recipe", fp8_linears.RECIPES)
def test_tiny_vit_forward_backward_and_loss_curve_follow_fp32(recipe):
    x, y = torch.randn(4, 20, 16, 32), torch.randn(4, 20, 16, 32)

    def forward_backward(model):
        out = model(x)
        ((out - y) ** 2).mean().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, fp8 = tiny_vit(), tiny_vit()
    fp8_linears.convert(list(fp8.blocks), recipe, CPU)
    (out_ref, grad_ref), (out, grad) = forward_backward(ref), forward_backward(fp8)
    assert rel(out, out_ref) < 2 ** -6 and rel(grad, grad_ref) < 2 ** -5
    assert not torch.equal(out, out_ref)

    def curve(model, steps=6):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(steps):
            xb = torch.randn(4, 20, 16, 32, generator=gen)
            loss = ((model(xb) - 0.5 * xb.roll(1, dims=-1)) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    ref, fp8 = tiny_vit(), tiny_vit()
    fp8_linears.convert(list(fp8.blocks), recipe, CPU)
    losses_ref, losses = curve(ref), curve(fp8)
    assert losses == pytest.approx(losses_ref, rel=1e-3)
    assert losses[-1] < 0.95 * losses[0]


def test_only_the_blocks_linears_are_converted():
    from torchao.float8.float8_linear import Float8Linear
    model = tiny_vit()
    names = {n for n, p in model.state_dict().items()}
    assert fp8_linears.convert(list(model.blocks), "tensorwise", CPU) == 8
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == [f"blocks.{b}.{layer}" for b in (0, 1)
                         for layer in ("attn.proj", "attn.qkv", "mlp.fc1", "mlp.fc2")]
    assert type(model.head) is nn.Linear and type(model.patch_embed.proj) is nn.Conv2d
    assert set(model.state_dict()) == names  # the same parameters under the same names
    assert not fp8_linears.fits(20 * 4 * 4 + 8, 64) and fp8_linears.fits(96, 32)


def test_a_block_linear_with_dims_off_16_is_left_alone():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 40))
    assert fp8_linears.convert([model], "tensorwise", CPU) == 1
    assert type(model[1]) is nn.Linear


# ----------------------------------------------------------------------------- train.py's path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("fp8_data"))


def run_vit(era5, expdir, **kw):
    """The engine's Trainer on the tiny ViT (global batch 8, lr 1e-3), every step's loss. One
    validation batch of 8 (the year's 39 samples are 5 batches, the last a compiled run's
    second evaluation graph): no assertion reads the validation."""
    cfg = vit_cfg(era5, expdir, **({"num_iters": 6, "checkpoint_every": 3,
                                    "limit_nsamples_val": 8} | kw))
    tr = Recording(cfg, setup_runtime(cfg))
    tr.fit()
    fp8 = [m for m in tr.model.modules() if type(m).__name__ == "Float8Linear"
           or getattr(m, "local_linear", nn.functional.linear) is not nn.functional.linear]
    return dict(losses=tr.step_losses, norms=tr.step_norms, run_dir=tr.run_dir,
                final=tr.sharding.model_state(tr.model), fp8=len(fp8),
                kinds={type(m).__name__ for m in tr.model.modules()})


def test_fp8_run_trains_checkpoints_and_resumes_exactly(data, tmp_path):
    era5 = data["era5"]
    whole = run_vit(era5, str(tmp_path / "whole"), **FP8)
    assert whole["fp8"] == 4 and "Float8Linear" in whole["kinds"]
    assert whole["losses"][-1] < 0.95 * whole["losses"][0]
    bf16 = run_vit(era5, str(tmp_path / "bf16"), amp_mode="bf16")
    assert whole["losses"] == pytest.approx(bf16["losses"], rel=2e-3)
    assert whole["losses"] != bf16["losses"]
    step3 = checkpoint.written_for(os.path.join(whole["run_dir"], "checkpoints"), 3)
    resumed = run_vit(era5, str(tmp_path / "resumed"), resume_from=step3, **FP8)
    assert resumed["losses"] == whole["losses"][3:]
    for k, v in whole["final"].items():
        assert torch.equal(v, resumed["final"][k]), k
    cfg = vit_cfg(era5, str(tmp_path / "changed"), resume_from=step3, num_iters=6,
                  amp_mode="bf16")
    with pytest.raises(ConfigError, match="fp8_linears tensorwise -> none"):
        Recording(cfg, setup_runtime(cfg))


@pytest.mark.compile
def test_compiled_fp8_run_follows_the_eager_one(data, tmp_path):
    """The linears converted before torch.compile traces the model: the compiled graphs hold
    torchao's fp8 casts and matmuls (emulated here)."""
    eager = run_vit(data["era5"], str(tmp_path / "eager"), num_iters=3, **FP8)
    compiled = run_vit(data["era5"], str(tmp_path / "compiled"), num_iters=3, enable_jit="true",
                       **FP8)
    assert compiled["fp8"] == 4 and compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)


def rank_runs(era5, exp):
    """On each of 2 gloo ranks: FSDP over both, and tp = 2 (one data-parallel rank) with and
    without sequence parallelism."""
    short = dict(FP8, num_iters=3, checkpoint_every=0)  # no assertion reads a checkpoint
    return dict(fsdp=run_vit(era5, os.path.join(exp, "fsdp"), fsdp=True, **short),
                tp=run_vit(era5, os.path.join(exp, "tp"), tensor_parallel=2, **short),
                tp_no_sp=run_vit(era5, os.path.join(exp, "tp_no_sp"), tensor_parallel=2,
                                 **dict(short, num_iters=2), sequence_parallel=False))


def test_fsdp_and_tensor_parallel_runs_follow_the_serial_fp8_run(data, tmp_path):
    serial = run_vit(data["era5"], str(tmp_path / "serial"), num_iters=3, checkpoint_every=0,
                     **FP8)
    ranks = run_ranks(rank_runs, 2, data["era5"], str(tmp_path / "ranks"), timeout=300)
    # each FSDP rank reports the loss of its half of the batch, the tp ranks the replica's
    fsdp_losses = [sum(r["fsdp"]["losses"][i] for r in ranks) / 2 for i in range(3)]
    assert fsdp_losses == pytest.approx(serial["losses"], rel=2e-3)
    for r in ranks:
        assert r["fsdp"]["norms"] == pytest.approx(serial["norms"], rel=5e-3)
        assert r["tp"]["losses"] == pytest.approx(serial["losses"][:3], rel=1e-2)
        assert r["tp"]["norms"] == pytest.approx(serial["norms"][:3], rel=2e-2)
        assert r["tp_no_sp"]["losses"] == pytest.approx(serial["losses"][:2], rel=1e-2)
        # the serial linears (FSDP) and the tp linears' slices (4 in the one block) in fp8
        assert r["fsdp"]["fp8"] == r["tp"]["fp8"] == 4
        assert "Float8Linear" in r["fsdp"]["kinds"] and "ParallelViT" in r["tp"]["kinds"]


def test_a_device_whose_fp8_matmul_fails_is_refused(monkeypatch):
    import torchao.float8 as float8

    def broken(module, config=None, module_filter_fn=None):
        def fail(*args):
            raise RuntimeError("scaled_mm: no kernel for this device\n(details)")
        module.register_forward_pre_hook(fail)
        return module
    monkeypatch.setattr(float8, "convert_to_float8_training", broken)
    with pytest.raises(ConfigError, match=r"^fp8_linears=rowwise fails on cpu \(scaled_mm: no "
                                          r"kernel for this device\): use --fp8_linears none "
                                          r"or tensorwise$"):
        fp8_linears.check("rowwise", CPU)


def test_tensor_parallel_linears_take_the_fp8_matmul():
    from distributed.groups import ParallelGroups
    from distributed.layers import ColumnParallelLinear, RowParallelLinear, load_serial_state_dict
    groups = ParallelGroups(tensor_parallel=1, context_parallel=1)
    torch.manual_seed(0)
    serial = nn.Linear(32, 48)
    x = torch.randn(2, 8, 32)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(32, 48, groups)
        load_serial_state_dict(layer, serial.state_dict(), groups)
        block = nn.ModuleDict({"layer": layer})
        assert fp8_linears.convert([block], "tensorwise", CPU) == 1
        assert layer.local_linear is not nn.functional.linear
        fp8 = nn.Sequential(copy.deepcopy(serial))
        fp8_linears.convert([fp8], "tensorwise", CPU)
        torch.testing.assert_close(layer(x), fp8(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- refusals


def test_fp8_needs_bf16_and_block_dims_in_multiples_of_16(tmp_path):
    with pytest.raises(ConfigError, match="fp8_linears=tensorwise runs with amp_mode bf16 .*"
                                          "not amp_mode=fp16: add --amp_mode bf16"):
        vit_cfg(str(tmp_path), str(tmp_path), amp_mode="fp16", fp8_linears="tensorwise")
    with pytest.raises(ConfigError, match="embed_dim=40 is not; .* multiple of 16, or "
                                          "--fp8_linears none"):
        vit_cfg(str(tmp_path), str(tmp_path), embed_dim=40, num_heads=2, **FP8)
    with pytest.raises(ConfigError, match="embed_dim=48 / tensor_parallel=2 = 24 is not"):
        vit_cfg(str(tmp_path), str(tmp_path), embed_dim=48, num_heads=2, tensor_parallel=2,
                **FP8)
    with pytest.raises(ConfigError, match=r"hidden width \(embed_dim x mlp_ratio\)=72 is not"):
        vit_cfg(str(tmp_path), str(tmp_path), mlp_ratio=2.25, **FP8)
    vit_cfg(str(tmp_path), str(tmp_path), amp_mode="fp16")  # fp8 off: nothing to check


def test_unet_has_no_fp8_linears(tmp_path):
    with pytest.raises(ConfigError, match="'fp8_linears' .* a setting of vit configs, not of "
                                          "unet ones"):
        build_config(os.path.join(ROOT, "config", "UNet.yaml"), "quickstart",
                     {"fp8_linears": "tensorwise"})


def test_missing_torchao_is_refused_with_the_install_command(tmp_path, monkeypatch):
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ModuleNotFoundError
    cfg = vit_cfg(str(tmp_path), str(tmp_path / "logs"), **FP8)
    with pytest.raises(ConfigError, match=r"fp8_linears=tensorwise needs torchao's float8 "
                                          r"training \(.*\): pip install -r "
                                          r"requirements-fp8.txt, or train without fp8"):
        setup_runtime(cfg)
    assert not (tmp_path / "logs").exists()


def test_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    with pytest.raises(ConfigError, match=r"fp8_linears=rowwise needs a GPU with fp8 tensor "
                                          r"cores \(compute capability 8.9 or newer.*\); NVIDIA "
                                          r"A100-SXM4-40GB is 8.0: use --fp8_linears none"):
        fp8_linears.check("rowwise", torch.device("cuda", 0))
    fp8_linears.check("none", torch.device("cuda", 0))  # off: nothing is asked of the GPU


def test_refusal_is_one_line_exit_2_and_writes_nothing(tmp_path):
    exp = tmp_path / "logs"
    r = preloaded.run([sys.executable, "train.py", "--fp8_linears", "rowwise", "--expdir",
                       str(exp), "--data_root", str(tmp_path)], cwd=ROOT, capture_output=True,
                      text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and not exp.exists()
    assert r.stderr.strip().splitlines() == [
        "error: fp8_linears=rowwise runs with amp_mode bf16 (the rest of the model in bf16 "
        "around the fp8 matmuls), not amp_mode=none: add --amp_mode bf16"]


# ----------------------------------------------------------------------------- the benchmark


def test_benchmark_times_bf16_against_each_recipe_in_emulation(capsys, tmp_path):
    from benchmarks import fp8_linears as bench
    bench.main(["--small", "--recipes", "tensorwise", "rowwise", "--steps", "1", "--rounds",
                "2", "--budget", "120", "--json", str(tmp_path / "fp8.json")])
    out = capsys.readouterr().out.splitlines()
    written = json.loads((tmp_path / "fp8.json").read_text())  # as benchmarks/gpu_runs reads it
    assert written["markdown"].splitlines() == out[3:]
    assert [r["recipe"] for r in written["rows"]] == ["none", "tensorwise", "rowwise"]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out
            if line.startswith("| ") and "linears" not in line}
    assert list(rows) == ["bf16", "fp8 tensorwise", "fp8 rowwise"]
    assert float(rows["bf16"][3]) == 1.0 and all(float(r[0]) > 0 for r in rows.values())
    assert [line.split(":")[0] for line in out[:3]] == list(rows)  # each built, first step
    assert out[3].startswith("cpu, torch") and "eager" in out[3]
    assert out[-1].startswith("fastest fp8: fp8 ") and "the 1.15x bar" in out[-1]


def test_benchmark_without_a_gpu_says_to_use_small(tmp_path, capsys):
    from benchmarks import fp8_linears as bench
    with pytest.raises(SystemExit) as e:
        bench.main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert re.match("error: no CUDA GPU here: .* --small runs a toy ViT", err), err
    kept = tmp_path / "rows.json"
    kept.write_text("earlier rows")
    for argv, says in ((["--small", "--json", str(kept)], f"argument --json: {kept} exists"),
                       (["--small", "--rounds", "1"], "argument --rounds: 1 is below 2")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {says}") and err.count("\n") == 1
    assert kept.read_text() == "earlier rows"
