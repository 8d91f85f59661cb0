"""The tutorial's models and optimiser as the configs' defaults: LeakyReLU slope, LayerNorm
epsilon, bias-free ViT head, Adam betas and the U-Net learning-rate schedule; and the Adam
builder (betas, fused kernel or its fallback)."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import optimizer as optimizer_module
from settings.parse import build_config
from engine.optimizer import lr_at
from engine.optimizer import build_optimizer
from tasks import make_task

from conftest import ROOT

VIT = f"{ROOT}/config/ViT.yaml"
UNET = f"{ROOT}/config/UNet.yaml"
SMALL_VIT = {"img_size": "[16,32]", "patch_size": "4", "embed_dim": "32", "depth": "2",
             "num_heads": "2"}
SMALL_UNET = {"base_width": "2", "max_width": "8", "full_scale": "false", "data_size": "32"}


def test_unet_base_uses_the_tutorial_leaky_relu_slope():
    cfg = build_config(UNET, "base", SMALL_UNET)
    model = make_task(cfg).build_model()
    slopes = {m.negative_slope for m in model.modules() if isinstance(m, nn.LeakyReLU)}
    assert cfg.leaky_relu_slope == 0.01 and slopes == {0.01}
    # The first level really applies it: negative pre-activations are scaled by 0.01, not 0.2.
    x = torch.randn(1, 4, 32, 32, 32)
    conv = model.down[0][0]
    pre = conv(x)
    assert (pre < 0).any()
    assert torch.allclose(model.down[0](x), F.leaky_relu(pre, 0.01))
    assert not torch.allclose(model.down[0](x), F.leaky_relu(pre, 0.2))


def test_unet_slope_changes_the_output_only_through_the_encoder():
    torch.manual_seed(0)
    a = make_task(build_config(UNET, "base", SMALL_UNET)).build_model()
    b = make_task(build_config(UNET, "base", {**SMALL_UNET, "leaky_relu_slope": "0.2"})).build_model()
    b.load_state_dict(a.state_dict())  # same weights: only the slope differs
    x = torch.randn(2, 4, 32, 32, 32)
    assert not torch.allclose(a(x), b(x))


def test_vit_base_has_the_tutorial_norms_head_and_betas():
    cfg = build_config(VIT, "base", SMALL_VIT)
    assert (cfg.layer_norm_eps, cfg.head_bias, cfg.adam_betas) == (1e-6, False, [0.9, 0.95])
    model = make_task(cfg).build_model()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 1 and {m.eps for m in norms} == {1e-6}
    assert model.head.bias is None and "head.bias" not in model.state_dict()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # initialised without a bias
    opt = build_optimizer(model.parameters(), 1e-3, cfg.adam_betas, cfg.enable_fused,
                          torch.device("cpu"))
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0
    # head_bias / layer_norm_eps as settings
    other = make_task(build_config(VIT, "base", {**SMALL_VIT, "head_bias": "true",
                                                 "layer_norm_eps": "1e-5"})).build_model()
    assert other.head.bias is not None and other.norm.eps == 1e-5


def test_unet_optimiser_and_schedule_follow_the_tutorial():
    """Adam with torch's default betas; at the base batch no warm-up and a cosine down to 0;
    the scaled-batch configs warm up for 128 steps."""
    base = build_config(UNET, "base")
    assert base.adam_betas == [0.9, 0.999] and (base.warmup_steps, base.end_lr) == (0, 0.0)
    assert lr_at(0, 2e-4, base.end_lr, base.warmup_steps, 100) == pytest.approx(2e-4)
    assert lr_at(99, 2e-4, base.end_lr, base.warmup_steps, 100) < 1e-7
    assert build_config(UNET, "bs64_opt").warmup_steps == 0
    assert build_config(UNET, "bs512_opt").warmup_steps == 128


def _vit(ckpt, dropout=0.0):
    torch.manual_seed(0)
    return make_task(build_config(VIT, "base", {**SMALL_VIT, "depth": "3", "dropout": str(dropout),
                                                "activation_checkpointing": str(ckpt)})).build_model()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_gives_the_same_output_and_gradients(dropout):
    plain, ckpt = _vit(False, dropout), _vit(True, dropout)
    assert ckpt.activation_checkpointing and not plain.activation_checkpointing
    calls = []
    for blk in ckpt.blocks:  # (recomputation stops once it has what backward needs: count fc1)
        blk.mlp.fc1.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 20, 16, 32)
    outs = []
    for m in (plain, ckpt):
        torch.manual_seed(1)  # same dropout masks (checkpoint replays the RNG when recomputing)
        y = m(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (y0, g0), (y1, g1) = outs
    assert torch.allclose(y0, y1, atol=1e-6)
    assert g0.keys() == g1.keys() and all(torch.allclose(g0[n], g1[n], atol=1e-6) for n in g0)
    assert len(calls) == 2 * 3  # each block ran again in backward
    calls.clear()
    with torch.no_grad():
        ckpt(x)
    assert len(calls) == 3  # nothing to recompute for: each block runs once


def _step_results(opt_kwargs_cfg, monkeypatch=None):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 3))
    opt = build_optimizer([w], 1e-2, opt_kwargs_cfg.adam_betas, opt_kwargs_cfg.enable_fused,
                          torch.device("cpu"))
    for _ in range(3):
        opt.zero_grad()
        (w ** 3).sum().backward()
        opt.step()
    return opt, w.detach()


def test_fused_adam_on_cpu_matches_the_default():
    cfg = build_config(VIT, "base", {"adam_betas": "[0.8, 0.9]"})
    plain, w_plain = _step_results(cfg)
    cfg.enable_fused = True
    fused, w_fused = _step_results(cfg)
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    assert fused.defaults["betas"] == plain.defaults["betas"] == (0.8, 0.9)
    assert torch.allclose(w_fused, w_plain, atol=1e-6) and not torch.equal(w_plain, torch.zeros(5, 3))


def test_fused_adam_falls_back_with_a_warning(monkeypatch, caplog):
    cfg = build_config(VIT, "base", {"enable_fused": "true"})
    monkeypatch.setattr(optimizer_module, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    with caplog.at_level(logging.WARNING, logger="engine.optimizer"):
        opt, w = _step_results(cfg)
    assert not opt.defaults.get("fused") and opt.defaults["betas"] == (0.9, 0.95)
    assert any("fused Adam is not available" in r.getMessage() and "cpu" in r.getMessage()
               for r in caplog.records)
    cfg.enable_fused = False
    _, w_plain = _step_results(cfg)
    assert torch.equal(w, w_plain)


def test_fused_adam_refused_for_unsupported_parameters():
    cfg = build_config(VIT, "base", {"enable_fused": "true"})
    meta = nn.Parameter(torch.zeros(3, device="meta"))  # a device without fused kernels
    opt = build_optimizer([meta], 1e-3, cfg.adam_betas, cfg.enable_fused, torch.device("cpu"))
    assert not opt.defaults.get("fused")


# ---- weights of the tutorial's own models (init_from)

def _tutorial_vit_output(sd, model, x, p, c):
    """The tutorial's forward_head on our trunk: tokens -> (h, w, p, p, C) -> image."""
    t = model.norm(_trunk(model, x))
    B, (h, w), E = t.shape[0], model.patch_embed.grid, t.shape[-1]
    y = t.reshape(B, h, w, E) @ sd["head.weight"].T  # (B, h, w, p*p*C)
    y = torch.einsum("nhwpqc->nchpwq", y.reshape(B, h, w, p, p, c))
    return y.reshape(B, c, h * p, w * p)


def _trunk(model, x):
    x = model.patch_embed(x) + model.pos_embed
    for blk in model.blocks:
        x = blk(x)
    return x


def test_vit_weights_in_the_tutorial_layout_load(tmp_path):
    from engine.checkpoint.start_weights import load_start_weights

    cfg = build_config(VIT, "base", {**SMALL_VIT, "n_out_channels": "3"})
    p, c = cfg.patch_size, 3
    torch.manual_seed(0)
    src = make_task(cfg).build_model()
    # The tutorial's state dict: our trunk's tensors under its names (from under DDP), separate
    # q/k/v, and a head whose rows are ordered (p, p, C): random, so a wrong order shows.
    sd = {f"module.{k}": v.clone() for k, v in src.state_dict().items() if "qkv" not in k}
    for k, v in src.state_dict().items():
        if "qkv" in k:
            for name, part in zip("qkv", v.chunk(3)):
                sd[f"module.{k.replace('qkv', name)}"] = part.clone()
    sd["module.head.weight"] = torch.randn(p * p * c, 32)
    torch.save(sd, tmp_path / "vit.pt")

    torch.manual_seed(1)
    dst = make_task(cfg).build_model()
    load_start_weights(dst, str(tmp_path / "vit.pt"), make_task(cfg).from_reference, cfg)
    x = torch.randn(2, 20, 16, 32)
    with torch.no_grad():
        want = _tutorial_vit_output({"head.weight": sd["module.head.weight"]}, src, x, p, c)
        assert torch.allclose(dst(x), want, atol=1e-5)
        assert torch.equal(dst.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)

    with_bias = build_config(VIT, "base", {**SMALL_VIT, "n_out_channels": "3", "head_bias": "true"})
    with pytest.raises(ValueError, match="has no bias: set head_bias false"):
        load_start_weights(make_task(with_bias).build_model(), str(tmp_path / "vit.pt"),
                           make_task(with_bias).from_reference, with_bias)
    # separate q/k/v weights, one of them missing: named, not a KeyError
    torch.save({k: v for k, v in sd.items() if ".attn.k." not in k}, tmp_path / "part.pt")
    with pytest.raises(ValueError, match=r"init_from=.*part\.pt: blocks\.0\.attn\.q\.weight has "
                       r"no blocks\.0\.attn\.k\.weight beside it: give the whole model's "
                       r"state_dict\(\)"):
        load_start_weights(make_task(cfg).build_model(), str(tmp_path / "part.pt"),
                           make_task(cfg).from_reference, cfg)
    wider = build_config(VIT, "base", {**SMALL_VIT, "embed_dim": "64", "n_out_channels": "3"})
    with pytest.raises(ValueError, match=r"does not fit this model \(.*pos_embed"):
        load_start_weights(make_task(wider).build_model(), str(tmp_path / "vit.pt"),
                           make_task(wider).from_reference, wider)


def test_unet_weights_in_the_tutorial_layout_load(tmp_path):
    from engine.checkpoint.start_weights import load_start_weights

    cfg = build_config(UNET, "base", {**SMALL_UNET, "full_scale": "true", "data_size": "64"})
    torch.manual_seed(0)
    src = make_task(cfg).build_model()
    names = {f"down.{i}.0": f"conv_down{i + 1}.0" for i in range(6)}
    names.update({f"up.{j}.0": f"conv_up{6 - j}.0" for j in range(5)})
    names["last"] = "conv_last"
    sd = {}
    for k, v in src.state_dict().items():
        mod, leaf = k.rsplit(".", 1)
        sd[f"_orig_mod.{names[mod]}.{leaf}"] = v.clone()
    assert len(sd) == 24  # 12 convolutions, weight and bias each
    torch.save(sd, tmp_path / "unet.pt")
    torch.manual_seed(1)
    dst = make_task(cfg).build_model()
    load_start_weights(dst, str(tmp_path / "unet.pt"), make_task(cfg).from_reference, cfg)
    for name, t in src.state_dict().items():  # every tensor in its place, exactly
        assert torch.equal(dst.state_dict()[name], t), name
    x = torch.randn(1, 4, 64, 64, 64)
    with torch.no_grad():  # (the CPU may pick another 3-D convolution kernel: ~1e-5)
        torch.testing.assert_close(dst(x), src(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="init_from=.*: no such file"):
        load_start_weights(dst, str(tmp_path / "none.pt"), make_task(cfg).from_reference, cfg)
