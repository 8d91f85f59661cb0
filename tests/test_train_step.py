"""The optimizer step of train.py: gradient accumulation and gradient clipping, in one process.

- ``--grad_accum_steps K`` takes each step's batch in K micro-batches: the losses, the gradients
  the optimizer applies and the weights equal those of the one-batch step (float32, summation
  order only), for the ViT and the U-Net;
- ``--max_grad_norm C`` scales the gradient to norm C when it is larger; the step returns the
  norm before clipping, which TensorBoard shows as ``Grad norm``; 0 measures without clipping.
The data-parallel forms (DDP ``no_sync`` on the inner micro-batches; the norm of the
all-reduced gradient) are checked on gloo ranks in tests/test_ddp.py, the tensor/context
parallel norm in tests/test_mp_model.py.
"""
import os

import pytest
import torch

from conftest import ROOT, write_cosmo, write_era5
from train import Trainer
from settings.parse import build_config
from settings.errors import ConfigError
from engine.runtime import setup_runtime

TINY_VIT = dict(img_size="[16,32]", patch_size="4", embed_dim="32", depth="1", num_heads="2",
                global_batch_size="8", base_batch_size="8", lr="1e-3", warmup_steps="0",
                synthesize_if_missing="false", log_every="1", num_data_workers="0", dropout="0")
TINY_UNET = dict(base_width="4", max_width="16", data_size="32", Nsamples="16", Nsamples_val="8",
                 global_batch_size="4", base_batch_size="4", lr="1e-3", warmup_steps="0",
                 synthesize_if_missing="false", num_data_workers="0", log_every="1")


class Noting(Trainer):
    """Notes every step's loss and gradient norm, and the gradients the optimizer applies."""

    def __init__(self, cfg, rt):
        super().__init__(cfg, rt)
        self.losses, self.norms, self.applied = [], [], []
        self.optimizer.register_step_pre_hook(self._note)

    def _note(self, optimizer, args, kwargs):
        self.applied.append(torch.cat([p.grad.flatten() for p in self.model.parameters()]).clone())

    def train_step(self, x, y, *args, **kwargs):
        loss, norm = super().train_step(x, y, *args, **kwargs)
        self.losses.append(loss.item())
        self.norms.append(norm.item())
        return loss, norm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("step_data")
    era5 = write_era5(str(base / "era5"), steps=20)
    cosmo = base / "cosmo"
    write_cosmo(str(cosmo / "train.h5"), side=32, seed=0)
    write_cosmo(str(cosmo / "valid.h5"), side=32, seed=1)
    return dict(vit=era5, unet=str(cosmo), base=base)


_REFERENCE = {}


def reference(data, model):
    """The one-batch run of ``model``, trained once per test session."""
    if model not in _REFERENCE:
        _REFERENCE[model] = train(data, model, f"{model}-accum1")
    return _REFERENCE[model]


def train(data, model, name, steps=3, **kw):
    yaml = os.path.join(ROOT, "config", "ViT.yaml" if model == "vit" else "UNet.yaml")
    tiny = TINY_VIT if model == "vit" else TINY_UNET
    over = dict(tiny, data_root=data[model], expdir=str(data["base"] / name), num_iters=str(steps),
                **{k: str(v) for k, v in kw.items()})
    cfg = build_config(yaml, "quickstart", over)
    tr = Noting(cfg, setup_runtime(cfg))
    tr.fit()
    return tr


@pytest.mark.parametrize("model,k", [("vit", 2), ("vit", 4), ("unet", 4)])
def test_accumulated_micro_batches_equal_the_one_batch_step(data, model, k):
    one = reference(data, model)
    acc = train(data, model, f"{model}-accum{k}", grad_accum_steps=k)
    torch.testing.assert_close(acc.losses, one.losses, rtol=1e-6, atol=1e-7)
    for a, b in zip(acc.applied, one.applied):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    for (name, a), (_, b) in zip(acc.model.state_dict().items(), one.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(acc.norms, one.norms, rtol=1e-5, atol=0)


def test_clipping_scales_the_gradient_to_max_grad_norm_and_reports_the_norm_before(data):
    free = train(data, "vit", "clip-off", steps=1)
    # the unclipped step's norm is what the step reports, and the applied gradient has it
    assert free.norms[0] == pytest.approx(free.applied[0].norm().item(), rel=1e-5)
    cap = free.norms[0] / 10
    clipped = train(data, "vit", "clip-on", steps=2, max_grad_norm=cap)
    assert clipped.norms[0] == pytest.approx(free.norms[0], rel=1e-6)  # reported before clipping
    assert clipped.applied[0].norm().item() == pytest.approx(cap, rel=1e-5)
    torch.testing.assert_close(clipped.applied[0], free.applied[0] * cap / free.norms[0],
                               rtol=1e-5, atol=1e-9)  # same direction, shorter
    # a limit above the norm changes nothing
    loose = train(data, "vit", "clip-loose", steps=1, max_grad_norm=free.norms[0] * 10)
    torch.testing.assert_close(loose.applied[0], free.applied[0], rtol=0, atol=0)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(clipped.run_dir, "tensorboard"))
    acc.Reload()
    logged = [e.value for e in acc.Scalars("Grad norm")]
    assert logged == pytest.approx(clipped.norms, rel=1e-6)


@pytest.mark.parametrize("over,needle", [
    (dict(grad_accum_steps="3"), "grad_accum_steps=3 does not divide the 8 samples"),
    (dict(grad_accum_steps="0"), "grad_accum_steps=0"),
    (dict(max_grad_norm="-1"), "max_grad_norm=-1"),
])
def test_bad_accumulation_and_clipping_settings_name_the_fix(data, over, needle):
    cfg_over = dict(TINY_VIT, data_root=data["vit"], expdir=str(data["base"] / "bad"), **over)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart", cfg_over)
        setup_runtime(cfg)
