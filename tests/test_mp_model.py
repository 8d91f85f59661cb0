"""The sharded ViT equals the serial ViT: weights, output, loss, gradients, training.

One spawn of four gloo ranks runs every layout: tp in {1, 2, 4}, cp in {1, 2} and tp=2 x cp=2,
with the remaining ranks as data parallel (tp=1 -> dp=4, tp=2 or cp=2 -> dp=2). The global
batch of 4 samples is split over dp; the dp-averaged gradient must equal the serial gradient
of the whole batch. Gradients are reduced both with ``reduce_replicated_grad_shards`` and with DDP
(``replicated_grads_comm_hook``), and once with activation checkpointing.

The ``-rowsK`` layouts use an image of K patch rows that tp x cp does not divide (3 rows at
tp=2, 5 at tp=4, 6 at tp=2 x cp=2) and 9 patch columns, so that no token count of a cp band
divides by tp: ``parallelize_vit`` keeps sequence parallelism by padding each cp band's tokens
(1 padding token at tp=2, 3 at tp=4) and splitting them into tp chunks that are not whole patch
rows. Output, loss and every gradient must equal the serial ones, which fails if a padding
token were attended to or a gradient were summed over the wrong ranks. The ``-off`` layouts
turn sequence parallelism off (``sequence_parallel=False``: tokens split over cp only, plain
tensor parallelism); they fail if a parameter replicated over tp were marked for a gradient sum
over tp (or the loss summed over tp). With dropout, the tp-replicated activations must stay
identical on the tp ranks, also when checkpointing recomputes them.

The ``-rows45`` layouts cut 45 patch rows of 3 columns (patch 4, 180 x 12 pixels) over cp = 4
(bands of 12, 11, 11, 11 rows) or cp = 2 (23 and 22 rows; at tp = 2 the bands' 69 and 66 tokens
are padded to 70 and 66, so the bands differ in length and in padding), with and without
sequence parallelism: each rank's image rows are its band's, and output, loss, every gradient
and a few Adam steps equal the serial ones; the weights trained at cp = 4 load at tp = 2 x cp = 2
(and serially) and give the same output.

The training loss is the task's (``tasks.losses``) everywhere: besides the relative L2 loss, an
L1 loss with a density term (``L1Rho``) and a channel-weighted MSE declared in this file give
per-sample losses and gradients equal to the serial ones through ``engine.sharding.RowBandSharding``.
Serial-ViT options are mirrored: a head without bias, a LayerNorm eps, and the model's own
``activation_checkpointing``.

Tolerances: float64 rtol 1e-9, atol 1e-12 (equivalence up to summation order); float32
rtol 1e-4, atol 1e-6 for one float32 forward/backward; training (float32, Adam, 5 steps):
losses rtol 1e-5, final weights rtol 1e-4, atol 1e-5, Adam second moments rtol 1e-3.
"""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_harness import run_ranks  # noqa: E402

WORLD = 4
ROWS45 = (180, 12)  # 45 patch rows of 3 patches at patch 4
LAYOUTS = {  # name: (tensor_parallel, context_parallel, parallel_order, img_size or None for VIT's,
    #         sequence_parallel)
    "tp1-cp1-dp4": (1, 1, "tp-cp-dp", None, True),
    "tp2-dp2": (2, 1, "tp-cp-dp", None, True),
    "tp4": (4, 1, "tp-cp-dp", None, True),
    "cp2-dp2": (1, 2, "cp-dp-tp", None, True),
    "tp2-cp2": (2, 2, "tp-cp-dp", None, True),
    # padded sequence parallelism: tp x cp does not divide the patch rows, tp not the band's tokens
    "tp2-dp2-rows3": (2, 1, "tp-cp-dp", (12, 36), True),
    "tp4-rows5": (4, 1, "tp-cp-dp", (20, 36), True),
    "tp2-cp2-rows6": (2, 2, "cp-tp-dp", (24, 36), True),
    # sequence parallelism off
    "tp4-rows5-off": (4, 1, "tp-cp-dp", (20, 32), False),
    "tp2-cp2-rows6-off": (2, 2, "cp-tp-dp", (24, 32), False),
    # cp bands of different lengths
    "cp4-rows45": (1, 4, "cp-tp-dp", ROWS45, True),
    "tp2-cp2-rows45": (2, 2, "tp-cp-dp", ROWS45, True),
    "tp2-cp2-rows45-off": (2, 2, "cp-tp-dp", ROWS45, False),
}
TRAIN_LAYOUTS = {"tp2-dp2": "ddp", "cp2-dp2": "ddp", "tp2-cp2": "plain", "tp4-rows5": "ddp",
                 "tp2-cp2-rows6": "plain", "tp2-cp2-rows6-off": "plain", "cp4-rows45": "ddp",
                 "tp2-cp2-rows45": "plain"}
CKPT_LAYOUTS = ("tp2-cp2", "tp2-cp2-rows6", "tp2-cp2-rows6-off", "tp2-cp2-rows45")
LOSS_LAYOUTS = ("tp2-cp2", "tp2-dp2-rows3", "cp4-rows45", "tp2-cp2-rows45", "tp2-cp2-rows45-off")
OPTION_LAYOUTS = ("tp4", "tp2-cp2-rows45")
DROPOUT_LAYOUTS = ("tp4-rows5-off", "tp2-cp2-rows6-off", "tp2-cp2-rows6")
VIT = dict(img_size=(16, 32), patch_size=4, in_chans=3, out_chans=2, embed_dim=32, depth=2, num_heads=4,
           mlp_ratio=4.0)
GLOBAL_BATCH = 4
MEMORY_LAYOUTS = ("tp1-cp1-dp4", "tp4")
MEMORY_VIT = dict(img_size=(32, 64), patch_size=4, in_chans=4, out_chans=4, embed_dim=128, depth=2, num_heads=4,
                  mlp_ratio=4.0)
TOL = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-4, atol=1e-6),
       "loss32": dict(rtol=1e-5, atol=1e-7), "weights32": dict(rtol=1e-4, atol=1e-5),
       "moments32": dict(rtol=1e-3, atol=1e-12)}
CHECKS = ([(lay, kind) for lay in LAYOUTS for kind in ("mode", "weights", "forward", "grads-plain", "grads-ddp")]
          + [(lay, "checkpointing") for lay in CKPT_LAYOUTS] + [("tp2-cp2", "float32")]
          + [(lay, "training") for lay in TRAIN_LAYOUTS] + [("tp2-cp2", "serial-checkpoint")]
          + [("cp4-rows45", "uneven-checkpoint")]
          + [(lay, "dropout") for lay in DROPOUT_LAYOUTS]
          + [(lay, f"loss-{name}") for lay in LOSS_LAYOUTS for name in ("l1rho", "weighted-mse")]
          + [(lay, "options") for lay in OPTION_LAYOUTS])


def _serial_loss(pred, tar):
    return (torch.linalg.vector_norm((pred - tar).flatten(1), dim=1)
            / torch.linalg.vector_norm(tar.flatten(1), dim=1)).mean()


CHANNEL_WEIGHTS = (0.25, 1.5)
LAMBDA_RHO = 0.01


def _reference_losses(pred, tar):
    """Per-sample losses written directly (not as partial sums): {name: (B,)}."""
    l1 = (pred - tar).abs().mean(dim=(1, 2, 3))
    rho = (torch.exp(14 * pred[:, 0]) - torch.exp(14 * tar[:, 0])).abs().mean(dim=(1, 2))
    w = torch.tensor(CHANNEL_WEIGHTS, dtype=pred.dtype)
    return {"l1rho": l1 + LAMBDA_RHO * rho, "weighted-mse": ((pred - tar) ** 2).mean(dim=(2, 3)) @ w}


def _partial_sum_loss(name):
    from tasks.cosmo import L1Rho
    from tasks.losses import PartialSumLoss

    class ChannelWeightedMSE(PartialSumLoss):
        """sum_c w_c mean((pred_c - target_c)^2): sums [sum_c w_c sum (pred_c - target_c)^2, values
        per channel]."""

        def partial_sums(self, pred, target, rows=None):
            sq = (pred - target).pow(2).flatten(2).sum(2)  # (B, C)
            per_channel = pred[0, 0].numel()
            return torch.stack([sq @ torch.tensor(CHANNEL_WEIGHTS, dtype=sq.dtype),
                                sq.new_full((sq.shape[0],), per_channel)], dim=1)

        def finish(self, sums):
            return sums[:, 0] / sums[:, 1]

    return L1Rho(LAMBDA_RHO) if name == "l1rho" else ChannelWeightedMSE()


def _expected_rows(img, tp, cp, sp):
    """Image rows (start, stop) of every (cp_rank, tp_rank), from numpy's array_split of the patch
    rows: tp x cp row bands when sequence parallel and tp x cp divides the rows (or tp = 1), else cp
    bands shared by the tp ranks of a cp rank."""
    import numpy as np

    rows = img[0] // VIT["patch_size"]
    row_bands = tp == 1 or (sp and rows % (tp * cp) == 0)
    bands = np.array_split(np.arange(rows), tp * cp if row_bands else cp)
    out = {}
    for c in range(cp):
        for t in range(tp):
            b = bands[c * tp + t if row_bands else c]
            out[(c, t)] = (int(b[0]) * VIT["patch_size"], (int(b[-1]) + 1) * VIT["patch_size"])
    return out


def _data(seed, dtype, learnable=False, img=None):
    g = torch.Generator().manual_seed(seed)
    h, w = img or VIT["img_size"]
    x = torch.randn(GLOBAL_BATCH, VIT["in_chans"], h, w, generator=g, dtype=torch.float64)
    t = torch.randn(GLOBAL_BATCH, VIT["out_chans"], h, w, generator=g, dtype=torch.float64)
    if learnable:  # a target the model can fit, so that training moves the loss
        t = 0.8 * x[:, :2] - 0.5 * x[:, 1:3].roll(1, -1) + 0.1 * t
    return x.to(dtype), t.to(dtype)


def _activation_and_state_bytes(model, x, t, loss_fn):
    """Bytes of tensors saved for backward (parameters excluded) + 4 x parameter bytes
    (weights, gradients, two Adam moments): a proxy of the per-rank peak memory of a step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        st = tensor.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn(model(x), t)
    del loss
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(saved.values()), 4 * param_bytes


def _serial_vit(dtype, img=None, **kw):
    from networks.vit import ViT

    torch.manual_seed(0)
    m = ViT(**{**VIT, "img_size": img or VIT["img_size"], **kw}).to(dtype)
    # make LayerNorm/bias parameters non-trivial so that their gradients are tested too
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) * 0.1)
    return m


def _rank_main():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distributed.groups import build_groups
    from distributed.layers import (load_serial_state_dict, reduce_replicated_grad_shards, replicated_grads_comm_hook,
                                    serial_state_dict, tensors_from_serial, tensors_to_serial)
    from distributed.mappings import all_gather_along
    from distributed.parallelize import parallelize_vit as _parallelize
    from distributed.parallelize import sharded_loss
    from tasks.era5 import RelativeL2
    from engine.sharding import RowBandSharding

    def parallelize_vit(model, groups, activation_checkpointing=None):
        return _parallelize(model, groups, activation_checkpointing, sequence_parallel=sp)

    out = {}

    def dp_slice(t, groups):
        b = GLOBAL_BATCH // groups.dp_size
        return t[groups.dp_rank * b:(groups.dp_rank + 1) * b]

    def rel_l2(pm, y, t_band, groups):
        """The mean of the ERA5 task's per-sample loss over this rank's samples."""
        return sharded_loss(RelativeL2(), y, t_band, groups, pm.layout).mean()

    def step(pm, groups, x, t, reduce, wrapper=None):
        """Forward + backward of this rank's share; returns (output band, loss)."""
        model = wrapper or pm
        y = model(pm.shard_image(dp_slice(x, groups)))
        loss = rel_l2(pm, y, pm.shard_image(dp_slice(t, groups)), groups)
        loss.backward()
        if reduce:
            reduce_replicated_grad_shards(pm, groups, average_dp=True)
        return y, loss

    for lay, (tp, cp, order, img, sp) in LAYOUTS.items():
        groups = build_groups(WORLD, tp, cp, order)
        dtypes = ["float64", "float32"] if lay == "tp2-cp2" else ["float64"]
        for dname in dtypes:
            dtype = getattr(torch, dname)
            m = _serial_vit(dtype, img)
            x, t = _data(10, dtype, img=img)
            Y = m(x)
            L = _serial_loss(Y, t)
            L.backward()
            sgrads = {n: p.grad.clone() for n, p in m.named_parameters()}
            tag = "float32" if dname == "float32" else None

            pm = parallelize_vit(m, groups)
            if tag is None:
                rows = (img or VIT["img_size"])[0] // VIT["patch_size"]
                padded = sp and tp > 1 and rows % (tp * cp) != 0
                start, stop = _expected_rows(img or VIT["img_size"], tp, cp, sp)[(groups.cp_rank, groups.tp_rank)]
                out[(lay, "mode")] = [("sequence parallel", torch.tensor(pm.sequence_parallel), torch.tensor(sp),
                                       "exact"),
                                      ("padded", torch.tensor(pm.layout.padded), torch.tensor(padded), "exact"),
                                      ("image rows", torch.tensor(pm.image_rows()), torch.tensor([start, stop]),
                                       "exact"),
                                      ("band", pm.shard_image(x), x[..., start:stop, :], "exact")]
                got = serial_state_dict(pm, groups)
                out[(lay, "weights")] = [(n, got[n], p.detach(), "exact") for n, p in m.state_dict().items()]
            y, loss = step(pm, groups, x, t, reduce=True)
            grads = serial_state_dict(pm, groups, grads=True)
            tol = tag or "float64"
            fwd = [("output (gathered)", pm.gather_image(y).detach(), dp_slice(Y, groups).detach(), tol),
                   ("loss of dp share", loss.detach(), _serial_loss(dp_slice(Y, groups), dp_slice(t, groups)).detach(),
                    tol)]
            per_sample = sharded_loss(RelativeL2(), y.detach(), pm.shard_image(dp_slice(t, groups)), groups,
                                      pm.layout)
            want = (torch.linalg.vector_norm((Y - t).flatten(1), dim=1)
                    / torch.linalg.vector_norm(t.flatten(1), dim=1))
            fwd.append(("per-sample losses", per_sample, dp_slice(want, groups).detach(), tol))
            mean_loss = loss.detach().clone()
            if groups.dp_size > 1:
                dist.all_reduce(mean_loss, group=groups.dp_group)
                mean_loss /= groups.dp_size
            fwd.append(("dp-mean loss", mean_loss, L.detach(), tol))
            gchk = [(f"grad {n}", grads[n], sgrads[n], tol) for n in sgrads]
            if tag:
                out[(lay, tag)] = fwd + gchk
                continue
            out[(lay, "forward")] = fwd
            out[(lay, "grads-plain")] = gchk

            pm2 = parallelize_vit(m, groups)
            ddp = DDP(pm2, process_group=groups.dp_group)
            ddp.register_comm_hook(groups, replicated_grads_comm_hook)
            step(pm2, groups, x, t, reduce=False, wrapper=ddp)
            grads2 = serial_state_dict(ddp, groups, grads=True)
            out[(lay, "grads-ddp")] = [(f"grad {n}", grads2[n], sgrads[n], tol) for n in sgrads]

            if lay in CKPT_LAYOUTS:
                pm3 = parallelize_vit(m, groups, activation_checkpointing=True)
                y3, loss3 = step(pm3, groups, x, t, reduce=True)
                grads3 = serial_state_dict(pm3, groups, grads=True)
                out[(lay, "checkpointing")] = (
                    [("output", pm3.gather_image(y3).detach(), dp_slice(Y, groups).detach(), tol),
                     ("loss", loss3.detach(), _serial_loss(dp_slice(Y, groups), dp_slice(t, groups)).detach(), tol)]
                    + [(f"grad {n}", grads3[n], sgrads[n], tol) for n in sgrads])

            if lay in LOSS_LAYOUTS:  # other task losses, through the engine's RowBandSharding
                for name in ("l1rho", "weighted-mse"):
                    m.zero_grad()
                    ts = 0.1 * t  # keeps exp(14 x) of the density term moderate
                    want = _reference_losses(m(x), ts)[name]
                    want.mean().backward()
                    sg = {n: p.grad.clone() for n, p in m.named_parameters()}
                    pml = parallelize_vit(m, groups)
                    io = RowBandSharding(SimpleNamespace(loss=_partial_sum_loss(name)), pml, groups)
                    xb, tb = io.local_batch(dp_slice(x, groups), dp_slice(ts, groups))
                    got = io.loss(pml(xb), tb)
                    got.mean().backward()
                    reduce_replicated_grad_shards(pml, groups, average_dp=True)
                    gl = serial_state_dict(pml, groups, grads=True)
                    out[(lay, f"loss-{name}")] = ([("per-sample losses", got.detach(), dp_slice(want, groups).detach(),
                                                    tol)]
                                                  + [(f"grad {n}", gl[n], sg[n], tol) for n in sg])

        if lay in OPTION_LAYOUTS:  # head without bias, another LayerNorm eps, the model's own checkpointing
            mo = _serial_vit(torch.float64, img, head_bias=False, layer_norm_eps=1e-2, activation_checkpointing=True)
            x, t = _data(30, torch.float64, img=img)
            Y = mo(x)
            L = _serial_loss(Y, t)
            L.backward()
            pmo = parallelize_vit(mo, groups)  # checkpointing comes from the model
            y, loss = step(pmo, groups, x, t, reduce=True)
            grads = serial_state_dict(pmo, groups, grads=True)
            eps = [mod.eps for mod in pmo.modules() if isinstance(mod, torch.nn.LayerNorm)]
            out[(lay, "options")] = (
                [("head has no bias", torch.tensor(pmo.head.bias is None), torch.tensor(True), "exact"),
                 ("checkpointing on", torch.tensor(pmo.activation_checkpointing), torch.tensor(True), "exact"),
                 ("LayerNorm eps", torch.tensor(eps), torch.full((2 * VIT["depth"] + 1,), 1e-2), "exact"),
                 ("output", pmo.gather_image(y).detach(), dp_slice(Y, groups).detach(), "float64"),
                 ("loss", loss.detach(), _serial_loss(dp_slice(Y, groups), dp_slice(t, groups)).detach(), "float64")]
                + [(f"grad {n}", grads[n], p.grad, "float64") for n, p in mo.named_parameters()])

        if lay in MEMORY_LAYOUTS:  # per-rank memory proxy on a larger ViT, same local batch
            from networks.vit import ViT

            torch.manual_seed(0)
            big = ViT(**MEMORY_VIT)
            pmb = parallelize_vit(big, groups)
            g = torch.Generator().manual_seed(3)
            xb = torch.randn(2, MEMORY_VIT["in_chans"], *MEMORY_VIT["img_size"], generator=g)
            tb = torch.randn(2, MEMORY_VIT["out_chans"], *MEMORY_VIT["img_size"], generator=g)
            out[(lay, "memory")] = _activation_and_state_bytes(pmb, pmb.shard_image(xb), pmb.shard_image(tb),
                                                               lambda y, tt: rel_l2(pmb, y, tt, groups))

        if lay in DROPOUT_LAYOUTS:  # tp-replicated activations stay identical on the tp ranks
            md = _serial_vit(torch.float64, img, dropout=0.3)
            x, t = _data(20, torch.float64, img=img)
            res = []
            for ckpt in (False, True):
                pmd = parallelize_vit(md, groups, activation_checkpointing=ckpt).train()
                xs, ts = pmd.shard_image(dp_slice(x, groups)), pmd.shard_image(dp_slice(t, groups))
                torch.manual_seed(1000 + dist.get_rank())  # per-rank streams, as the engine seeds them
                y = pmd(xs)
                rel_l2(pmd, y, ts, groups).backward()
                reduce_replicated_grad_shards(pmd, groups, average_dp=True)
                res.append((y.detach(), serial_state_dict(pmd, groups, grads=True)))
            (y, grads), (y_ck, grads_ck) = res
            with torch.no_grad():
                y_eval = pmd.eval()(xs)
            copies = all_gather_along(y.unsqueeze(0), groups.tp_group, 0)
            out[(lay, "dropout")] = (
                [(f"output on tp rank {r} (same band)", copies[r], y, "exact") for r in range(tp)]
                + [("dropout is active", torch.tensor(bool((y - y_eval).abs().max() > 1e-3)), torch.tensor(True),
                    "exact"),
                   ("checkpointed output", y_ck, y, "float64")]
                + [(f"checkpointed grad {n}", grads_ck[n], grads[n], "float64") for n in grads])

        if lay in TRAIN_LAYOUTS:  # a few Adam steps, float32, serial vs sharded
            m = _serial_vit(torch.float32, img)
            pm = parallelize_vit(m, groups)
            ddp = None
            if TRAIN_LAYOUTS[lay] == "ddp":
                ddp = DDP(pm, process_group=groups.dp_group)
                ddp.register_comm_hook(groups, replicated_grads_comm_hook)
            opt_s = torch.optim.Adam(m.parameters(), lr=3e-3)
            opt_p = torch.optim.Adam(pm.parameters(), lr=3e-3)
            s_losses, p_losses = [], []
            for it in range(5):
                x, t = _data(100 + it, torch.float32, learnable=True, img=img)
                opt_s.zero_grad()
                ls = _serial_loss(m(x), t)
                ls.backward()
                opt_s.step()
                opt_p.zero_grad()
                _, lp = step(pm, groups, x, t, reduce=ddp is None, wrapper=ddp)
                opt_p.step()
                lp = lp.detach().clone()
                if groups.dp_size > 1:
                    dist.all_reduce(lp, group=groups.dp_group)
                    lp /= groups.dp_size
                s_losses.append(ls.detach())
                p_losses.append(lp)
            final = serial_state_dict(pm, groups)
            # Adam moments convert to the serial layout like the parameters
            moments = tensors_to_serial(pm, groups, {n: opt_p.state[p]["exp_avg_sq"] for n, p in pm.named_parameters()})
            out[(lay, "training")] = (
                [("losses", torch.stack(p_losses), torch.stack(s_losses), "loss32")]
                + [(f"weight {n}", final[n], p.detach(), "weights32") for n, p in m.named_parameters()]
                + [(f"adam exp_avg_sq {n}", moments[n], opt_s.state[p]["exp_avg_sq"], "moments32")
                   for n, p in m.named_parameters()])

            if lay == "tp2-cp2":
                # a serial-layout checkpoint of the trained sharded model loads into a serial model
                # and into another layout (tp=4), and both reproduce the sharded model's output
                from networks.vit import ViT

                x, t = _data(200, torch.float32)
                with torch.no_grad():
                    y_tp2cp2 = pm.gather_image(pm(pm.shard_image(x)))
                    serial = ViT(**VIT)
                    serial.load_state_dict(final)
                    y_serial = serial(x)
                    g4 = build_groups(WORLD, 4, 1, "tp-cp-dp")
                    pm4 = parallelize_vit(ViT(**VIT), g4)
                    load_serial_state_dict(pm4, final, g4)
                    y_tp4 = pm4.gather_image(pm4(pm4.shard_image(x)))
                out[(lay, "serial-checkpoint")] = [("serial model", y_serial, y_tp2cp2, "float32"),
                                                   ("tp=4 model", y_tp4, y_tp2cp2, "float32")]
            if lay == "cp4-rows45":
                # trained on cp bands of 12, 11, 11, 11 rows; loads on 23 + 22 rows at tp=2 (padded)
                from networks.vit import ViT

                x, _ = _data(200, torch.float32, img=img)
                g22 = build_groups(WORLD, 2, 2, "tp-cp-dp")
                with torch.no_grad():
                    y_cp4 = pm.gather_image(pm(pm.shard_image(x)))
                    serial = ViT(**{**VIT, "img_size": img})
                    serial.load_state_dict(final)
                    pm22 = parallelize_vit(ViT(**{**VIT, "img_size": img}), g22)
                    load_serial_state_dict(pm22, final, g22)
                    y22 = pm22.gather_image(pm22(pm22.shard_image(x)))
                back = tensors_to_serial(pm22, g22, tensors_from_serial(pm22, g22, moments))
                out[(lay, "uneven-checkpoint")] = (
                    [("serial model", serial(x).detach(), y_cp4, "float32"),
                     ("tp=2 x cp=2 model", y22, y_cp4, "float32"),
                     ("padded layout", torch.tensor(pm22.layout.padded), torch.tensor(True), "exact")]
                    + [(f"adam exp_avg_sq {n} through tp=2 x cp=2", back[n], moments[n], "exact") for n in moments])
    return out


def test_training_moves_the_loss(rank_results):
    for lay in TRAIN_LAYOUTS:
        (_, got, want, _), = [c for c in rank_results[0][(lay, "training")] if c[0] == "losses"]
        assert want[-1] < 0.98 * want[0], f"serial loss did not decrease: {want.tolist()}"


def test_memory_per_rank_tp4(rank_results):
    """Saved activations + parameter/gradient/Adam state per rank at tp=4 <= 35% of tp=1."""
    act1, state1 = rank_results[0][("tp1-cp1-dp4", "memory")]
    for rank, res in enumerate(rank_results):
        act4, state4 = res[("tp4", "memory")]
        ratio = (act4 + state4) / (act1 + state1)
        assert ratio <= 0.35, (f"rank {rank}: tp=4 holds {act4 + state4} bytes (activations {act4}, states "
                               f"{state4}) vs tp=1 {act1 + state1} ({act1}, {state1}): ratio {ratio:.3f}")
        assert act4 / act1 <= 0.35, f"rank {rank}: activation ratio {act4 / act1:.3f}"


@pytest.fixture(scope="module")
def rank_results():
    return run_ranks(_rank_main, WORLD, timeout=170)


@pytest.mark.parametrize("layout,kind", CHECKS, ids=[f"{lay}-{kind}" for lay, kind in CHECKS])
def test_sharded_vit_matches_serial(rank_results, layout, kind):
    for rank, res in enumerate(rank_results):
        for what, got, want, tol in res[(layout, kind)]:
            assert got.shape == want.shape, f"rank {rank} {what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
            if tol == "exact":
                assert torch.equal(got, want), f"rank {rank} {what}: {got} differs from {want}"
            else:
                torch.testing.assert_close(got, want, **TOL[tol], msg=lambda m: f"rank {rank} {what}: {m}")


# ---- invalid layouts: checked before any communication, so no processes are needed ------------

def _fake_groups(tp, cp, tp_rank=0, cp_rank=0):
    from distributed.groups import ParallelGroups

    return ParallelGroups(tensor_parallel=tp, context_parallel=cp, data_parallel=1, world_size=tp * cp,
                          tp_rank=tp_rank, cp_rank=cp_rank)


@pytest.mark.parametrize("vit,tp,cp,message", [
    (dict(embed_dim=32, num_heads=8), 3, 1, "tensor_parallel=3 does not divide num_heads=8: choose 1, 2, 4 or 8"),
    (dict(embed_dim=32, num_heads=4), 8, 1, "tensor_parallel=8 does not divide num_heads=4: choose 1, 2 or 4"),
    (dict(embed_dim=32, num_heads=4, mlp_ratio=25 / 32), 2, 1,
     "tensor_parallel=2 does not divide mlp hidden dim=25: choose 1, 5 or 25"),
    (dict(img_size=(16, 32)), 1, 8,
     "context_parallel=8 exceeds the 4 patch rows (img height 16 / patch_size 4): tokens are sharded over cp in "
     "whole patch rows, at least one per rank; choose context_parallel <= 4"),
    (dict(img_size=(12, 32)), 2, 4, "context_parallel=4 exceeds the 3 patch rows"),
])
def test_invalid_layouts(vit, tp, cp, message):
    from distributed.parallelize import parallelize_vit
    from networks.vit import ViT

    model = ViT(**{**VIT, **vit})
    with pytest.raises(ValueError) as e:
        parallelize_vit(model, _fake_groups(tp, cp))
    assert message in str(e.value)


def test_single_process_parallelize_is_serial():
    """Without torch.distributed (world 1) the parallel model is the serial one, bit for bit."""
    from distributed.groups import SINGLE_PROCESS, build_groups
    from distributed.layers import reduce_replicated_grad_shards, serial_state_dict
    from distributed.parallelize import parallelize_vit, sharded_loss
    from tasks.era5 import RelativeL2

    groups = build_groups()
    assert groups.tp_group is SINGLE_PROCESS and groups.mp_group is SINGLE_PROCESS
    m = _serial_vit(torch.float64)
    pm = parallelize_vit(m, groups, activation_checkpointing=True)
    x, t = _data(5, torch.float64)
    y = m(x)
    _serial_loss(y, t).backward()
    yp = pm(pm.shard_image(x))
    loss = sharded_loss(RelativeL2(), yp, pm.shard_image(t), groups, pm.layout).mean()
    loss.backward()
    reduce_replicated_grad_shards(pm, groups, average_dp=True)
    torch.testing.assert_close(pm.gather_image(yp), y, rtol=0, atol=0)
    torch.testing.assert_close(loss, _serial_loss(y, t), rtol=1e-12, atol=0)
    grads = serial_state_dict(pm, groups, grads=True)
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-15)


def test_image_band_needs_shard_image():
    from distributed.parallelize import parallelize_vit

    pm = parallelize_vit(_serial_vit(torch.float32), _fake_groups(2, 2))
    with pytest.raises(ValueError, match="expected this rank's band of 4 image rows x 32 columns"):
        pm(torch.zeros(1, VIT["in_chans"], *VIT["img_size"]))
    with pytest.raises(ValueError, match="shard_image takes whole images of 16 rows, got 4"):
        pm.shard_image(torch.zeros(1, VIT["in_chans"], 4, 32))


@pytest.mark.parametrize("img,tp,cp,sp", [(ROWS45, 1, 4, True), (ROWS45, 2, 2, True), (ROWS45, 2, 4, False),
                                          ((16, 32), 2, 2, True), ((20, 36), 4, 1, True)])
def test_image_rows_of_every_rank(img, tp, cp, sp):
    """``image_rows()`` are the real rows of each rank's band (array_split of the patch rows),
    ``shard_image`` cuts exactly them, and ``RowBandSharding.local_batch`` cuts whole images and passes a
    batch that already is the band (a loader reading only ``image_rows()``)."""
    from distributed.parallelize import parallelize_vit
    from networks.vit import ViT
    from engine.sharding import RowBandSharding

    serial = ViT(**{**VIT, "img_size": img})
    x = torch.randn(2, VIT["in_chans"], *img)
    y = torch.randn(2, VIT["out_chans"], *img)
    covered = set()
    for (c, t), (start, stop) in _expected_rows(img, tp, cp, sp).items():
        groups = _fake_groups(tp, cp, t, c)
        pm = parallelize_vit(serial, groups, sequence_parallel=sp)
        assert pm.image_rows() == (start, stop), f"cp rank {c}, tp rank {t}"
        assert torch.equal(pm.shard_image(x), x[..., start:stop, :])
        io = RowBandSharding(None, pm, groups)
        for xb, yb in (io.local_batch(x, y), io.local_batch(x[..., start:stop, :], y[..., start:stop, :])):
            assert torch.equal(xb, x[..., start:stop, :]) and torch.equal(yb, y[..., start:stop, :])
        covered.update(range(start, stop))
    assert covered == set(range(img[0]))


# ---- token layouts: chosen from the patch rows, no processes needed -------------------------------

@pytest.mark.parametrize("img,tp,cp,sp,want", [
    # (sequence_parallel, row_bands, bands, band_tokens, local_tokens, pad); patch 8, 90 columns at width 720
    ((360, 720), 1, 1, True, (True, True, 1, 4050, 4050, 0)),
    ((360, 720), 2, 1, True, (True, False, 1, 4050, 2025, 0)),
    ((360, 720), 4, 1, True, (True, False, 1, 4050, 1013, 2)),
    ((360, 720), 4, 1, False, (False, False, 1, 4050, 4050, 0)),
    ((360, 720), 1, 3, True, (True, True, 3, 1350, 1350, 0)),
    ((360, 720), 4, 3, True, (True, False, 3, 1350, 338, 2)),
    ((352, 720), 4, 1, True, (True, True, 4, 990, 990, 0)),
    ((352, 720), 2, 2, True, (True, True, 4, 990, 990, 0)),
    ((720, 1440), 4, 2, True, (True, False, 2, 8100, 2025, 0)),
    # cp not dividing the 45 rows: bands of 12, 11, 11, 11 rows (the values are those of the first)
    ((360, 720), 1, 4, True, (True, True, 4, 1080, 1080, 0)),
    ((360, 720), 2, 4, True, (True, False, 4, 1080, 540, 0)),
    ((360, 720), 4, 4, False, (False, False, 4, 1080, 1080, 0)),
    ((360, 712), 2, 4, True, (True, False, 4, 1068, 534, 0)),
])
def test_token_layout(img, tp, cp, sp, want):
    from distributed.parallelize import token_layout

    lay = token_layout(img, 8, tp, cp, sp)
    start, stop = lay.band_rows(0)  # band 0, a longest one
    band_tokens, local_tokens, pad = (stop - start) * lay.cols, lay.local_tokens_of(0), lay.pad_of(0)
    got = (lay.sequence_parallel, lay.row_bands, lay.bands, band_tokens, local_tokens, pad)
    assert got == want
    assert lay.padded is (want[0] and not want[1])
    assert local_tokens * (tp if lay.padded else 1) == band_tokens + pad


def test_uneven_cp_bands():
    """45 patch rows of 89 columns at cp=4, tp=2: bands of 12, 11, 11, 11 rows; the 11-row bands'
    979 tokens need one padding token for two equal tp chunks, the 12-row band's 1068 none."""
    from distributed.parallelize import token_layout

    lay = token_layout((360, 712), 8, 2, 4)
    assert lay.cp_band_rows() == (12, 11, 11, 11)
    assert lay.cp_band_tokens() == (1068, 979, 979, 979)
    assert [lay.local_tokens_of(c) for c in range(4)] == [534, 490, 490, 490]
    assert [lay.pad_of(c) for c in range(4)] == [0, 1, 1, 1]
    assert [lay.band_rows(b) for b in range(4)] == [(0, 12), (12, 23), (23, 34), (34, 45)]
    assert token_layout((360, 720), 8, 1, 45).cp_band_rows() == (1,) * 45


def _whole_params(pm, serial):
    full = dict(serial.named_parameters())
    return {n for n, p in pm.named_parameters() if p.shape == full[n].shape and n != "pos_embed"}


@pytest.mark.parametrize("img,tp,cp", [((24, 32), 4, 1), ((12, 32), 2, 1), ((16, 32), 4, 2), ((24, 32), 2, 2),
                                       (ROWS45, 2, 2)])
def test_padded_layout_shapes_and_markers(img, tp, cp):
    """Padded sequence parallelism: the image is cut over cp only, each rank holds a padded chunk
    of its cp band's tokens, and every parameter that is whole on a rank has its gradient summed
    over cp and tp (the ranks hold different tokens); pos_embed (the cp band's slice) over tp."""
    from distributed.parallelize import parallelize_vit
    from networks.vit import ViT

    groups = _fake_groups(tp, cp)
    serial = ViT(**{**VIT, "img_size": img})
    pm = parallelize_vit(serial, groups)
    assert pm.sequence_parallel and pm.layout.padded
    rows, cols = img[0] // 4, img[1] // 4
    first = -(-rows // cp)  # cp rank 0 holds a longest band
    assert pm.image_rows() == (0, first * 4)
    band_tokens = first * cols
    assert pm.layout.local_tokens_of(0) == -(-band_tokens // tp)
    assert pm.layout.pad_of(0) == (-band_tokens) % tp
    assert pm.pos_embed.shape == (1, band_tokens, 32) and pm.pos_embed.shard_spec.axes == ("cp",)
    whole = _whole_params(pm, serial)
    assert {"head.weight", "norm.bias", "patch_embed.proj.weight", "blocks.0.mlp.fc2.bias",
            "blocks.1.attn.proj.bias", "blocks.0.norm1.weight"} <= whole
    for n, p in pm.named_parameters():
        want = ("tp",) if n == "pos_embed" else ("cp", "tp") if n in whole else ("cp",)
        assert p.reduce_over == want, f"{n}: reduce_over {p.reduce_over}, expected {want}"
    assert all(b.attn.band_tokens == pm.layout.cp_band_tokens() for b in pm.blocks)


@pytest.mark.parametrize("img,tp,cp", [((24, 32), 4, 1), ((12, 32), 2, 1), ((16, 32), 4, 2), ((24, 32), 2, 2)])
def test_no_sequence_parallel_shapes_and_markers(img, tp, cp):
    """``sequence_parallel=False``: the tokens are split over cp only, and every parameter that is
    whole on a rank has its gradient summed over cp only (the tp ranks compute the same one)."""
    from distributed.parallelize import parallelize_vit
    from networks.vit import ViT

    groups = _fake_groups(tp, cp)
    serial = ViT(**{**VIT, "img_size": img})
    pm = parallelize_vit(serial, groups, sequence_parallel=False)
    assert pm.sequence_parallel is False and not pm.layout.padded
    rows = img[0] // 4
    assert pm.image_rows() == (0, img[0] // cp)
    assert pm.pos_embed.shape == (1, rows // cp * 8, 32) and pm.pos_embed.shard_spec.axes == ("cp",)
    assert set(dict(pm.named_parameters())) == set(dict(serial.named_parameters()))
    whole = _whole_params(pm, serial)
    assert {"head.weight", "norm.bias", "patch_embed.proj.weight", "blocks.0.mlp.fc2.bias",
            "blocks.1.attn.proj.bias", "blocks.0.norm1.weight"} <= whole
    for n, p in pm.named_parameters():
        want = () if n == "pos_embed" else ("cp",)
        assert p.reduce_over == want, f"{n}: reduce_over {p.reduce_over}, expected {want}"


def test_attention_band_tokens_are_checked():
    from distributed.layers import ParallelAttention

    with pytest.raises(ValueError, match=r"band_tokens=\[5, 4, 4\] must give the \(positive\) number of real tokens "
                                         r"of each of the context_parallel=2 bands"):
        ParallelAttention(32, 4, _fake_groups(1, 2), band_tokens=(5, 4, 4))


def test_activation_checkpointing_follows_the_model():
    """The serial model's ``activation_checkpointing`` is mirrored; an explicit argument wins."""
    from distributed.parallelize import parallelize_vit
    from networks.vit import ViT

    for flag in (False, True):
        serial = ViT(**VIT, activation_checkpointing=flag)
        assert parallelize_vit(serial, _fake_groups(2, 1)).activation_checkpointing is flag
        assert parallelize_vit(serial, _fake_groups(2, 1), activation_checkpointing=not flag
                               ).activation_checkpointing is (not flag)


def test_sequence_parallel_summary_lines():
    from distributed.parallelize import sequence_parallel_summary

    assert sequence_parallel_summary((360, 720), 8, 4, 1) == (
        "Sequence parallelism on, padded: the 45 patch rows do not divide by tensor_parallel x context_parallel = 4, "
        "so the 4050 tokens of each context-parallel band are split into 4 chunks of 1013, 2 padding tokens per "
        "band (an img_size whose patch rows divide by 4, e.g. [352, 720], also splits the image bands over "
        "tensor_parallel)")
    assert sequence_parallel_summary((360, 720), 8, 4, 1, False) == (
        "Sequence parallelism off (sequence_parallel=False): LayerNorm/residual activations are whole on each "
        "tensor-parallel rank (4050 tokens per context-parallel rank)")
    assert sequence_parallel_summary((352, 720), 8, 4, 1).startswith(
        "Sequence parallelism on: the 44 patch rows divide by tensor_parallel x context_parallel = 4")
    assert sequence_parallel_summary((360, 720), 8, 1, 3) == (
        "Sequence parallelism not needed at tensor_parallel=1: the 45 patch rows are split over "
        "context_parallel=3 (15 per rank)")
    # cp bands of different lengths (the tutorial's mp config at context_parallel=4)
    assert sequence_parallel_summary((360, 720), 8, 1, 4) == (
        "Sequence parallelism not needed at tensor_parallel=1: the 45 patch rows are split over "
        "context_parallel=4 (12 or 11 per rank)")
    assert sequence_parallel_summary((360, 712), 8, 2, 4) == (
        "Sequence parallelism on, padded: the 45 patch rows do not divide by tensor_parallel x context_parallel = 8, "
        "so the 1068 or 979 tokens of each context-parallel band are split into 2 chunks of 534 or 490, up to 1 "
        "padding token per band (an img_size whose patch rows divide by 8, e.g. [320, 712], also splits the image "
        "bands over tensor_parallel)")
    assert sequence_parallel_summary((360, 720), 8, 2, 4, False) == (
        "Sequence parallelism off (sequence_parallel=False): LayerNorm/residual activations are whole on each "
        "tensor-parallel rank (1080 or 990 tokens per context-parallel rank)")
