"""Statistics of the U-Net's prediction of a whole cosmology volume, predicted tile by tile
(``predict_tiled``), as emulators of hydrodynamic simulations are judged: per channel its power
spectrum, r(k), one-point distributions and errors, in float64. docs/scoring.md defines them."""
from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from datapipe.cosmo_data import CosmoCropDataset
from datapipe import generated_data
from observe.logging_utils import duration
from observe.score_report import Figure, Panel, Report
from settings.errors import ConfigError, DataError

log = logging.getLogger("score")

HIST_BINS = 60


def _shells(side: int) -> tuple[np.ndarray, np.ndarray]:
    """Each mode of ``np.fft.rfftn`` of a ``side``^3 box: its shell, and how many modes of the
    full spectrum it stands for (2, or 1 in the planes kz = 0 and kz = Nyquist)."""
    k = np.fft.fftfreq(side, 1.0 / side)
    kz = np.fft.rfftfreq(side, 1.0 / side)
    kmag = np.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2)
    count = np.full(kz.shape, 2.0)
    count[0] = 1.0
    if side % 2 == 0:
        count[-1] = 1.0
    return np.rint(kmag).astype(np.int64), np.broadcast_to(count, kmag.shape)


def cross_power(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k, P_ab, modes per shell) of two L^3 fields, as docs/scoring.md defines P_ab(k)."""
    if a.shape != b.shape or a.ndim != 3 or len(set(a.shape)) != 1:
        raise ValueError(f"fields of shapes {a.shape} and {b.shape}: need two L^3 boxes")
    side = a.shape[0]
    fa = np.fft.rfftn(np.asarray(a, np.float64) - np.mean(a, dtype=np.float64))
    fb = fa if b is a else np.fft.rfftn(np.asarray(b, np.float64) - np.mean(b, dtype=np.float64))
    shell, count = _shells(side)
    keep = (shell >= 1) & (shell <= side // 2)
    power = (fa.real * fb.real + fa.imag * fb.imag)[keep] / side**3
    n = np.bincount(shell[keep], weights=count[keep], minlength=side // 2 + 1)[1:]
    p = np.bincount(shell[keep], weights=(count[keep] * power), minlength=side // 2 + 1)[1:]
    return np.arange(1, side // 2 + 1), p / np.maximum(n, 1), n


def spectra(pred: np.ndarray, true: np.ndarray) -> dict:
    """P(k) of the prediction and of the truth, their ratio and r(k), for one channel."""
    k, p_true, modes = cross_power(true, true)
    _, p_pred, _ = cross_power(pred, pred)
    _, p_cross, _ = cross_power(pred, true)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(p_true > 0, p_pred / p_true, np.nan)
        denom = np.sqrt(p_pred * p_true)
        r = np.where(denom > 0, p_cross / denom, 0.0)
    return {"k": k, "modes": modes, "p_true": p_true, "p_pred": p_pred, "ratio": ratio, "r": r}


def histograms(pred: np.ndarray, true: np.ndarray, bins: int = HIST_BINS) -> dict:
    """One-point PDFs of one channel (docs/scoring.md)."""
    lo = float(min(np.min(true), np.min(pred)))
    hi = float(max(np.max(true), np.max(pred)))
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    h_true, h_pred = (np.histogram(a, edges, density=True)[0] for a in (true, pred))
    return {"centres": 0.5 * (edges[1:] + edges[:-1]), "true": h_true, "pred": h_pred}


def field_errors(pred: np.ndarray, true: np.ndarray) -> dict:
    """Means and errors of one channel, in float64 (docs/scoring.md, "Errors")."""
    p = np.asarray(pred, np.float64)
    t = np.asarray(true, np.float64)
    d = p - t
    norm = np.sqrt(np.sum(t * t))
    return {"mean_true": float(t.mean()), "mean_pred": float(p.mean()), "bias": float(d.mean()),
            "mae": float(np.abs(d).mean()), "rmse": float(np.sqrt(np.mean(d * d))),
            "relative_error": float(np.sqrt(np.sum(d * d)) / norm) if norm > 0 else float("nan")}


def unet_halo(levels: int) -> int:
    """The smallest halo that makes tiles exact for ``networks.unet``: an aligned tile's edge
    voxels read up to 2^(levels+1) - 1 voxels beyond it, rounded up to whole 2^levels."""
    return 2 * 2**levels


def tile_plan(side: int, tile: int, halo: int, align: int) -> list[tuple[int, int, int]]:
    """Along one axis of ``side`` voxels: (core start, core stop, window start) of each tile, as
    docs/scoring.md says (``align``: 2^levels)."""
    for name, v in (("side", side), ("tile", tile), ("halo", halo)):
        if v % align or (v < align and name != "halo"):
            # the multiples either side of v; a halo may be 0, a side or tile not
            near = [m for m in (v // align * align, (v // align + 1) * align)
                    if m >= align or name == "halo"]
            raise ConfigError(f"{name}={v} must be a multiple of {align} (2^levels of the U-Net): "
                              f"choose {' or '.join(map(str, near))}")
    window = min(side, tile + 2 * halo)
    return [(a, min(a + tile, side), min(max(a - halo, 0), side - window))
            for a in range(0, side, tile)]


def predict_tiled(forward, x: torch.Tensor, tile: int, halo: int, align: int, batch: int = 1,
                  progress=None, share: tuple[int, int] = (0, 1),
                  out_channels: int | None = None) -> torch.Tensor:
    """``forward`` of the volume ``x`` (1, C, L, L, L), up to ``batch`` windows of ``tile_plan``
    per call, then ``progress(done, total)``; the cores stitched into (1, C_out, L, L, L) float32
    on the CPU. ``share`` (rank, ranks): every ranks-th tile from the rank-th, the rest left 0
    (``out_channels`` makes the volume of a rank without a tile)."""
    side = x.shape[-1]
    if x.shape[0] != 1 or x.shape[2:] != (side,) * 3:
        raise ValueError(f"a volume of shape {tuple(x.shape)}: need (1, C, L, L, L)")
    window = min(side, tile + 2 * halo)
    tiles = list(itertools.product(tile_plan(side, tile, halo, align), repeat=3))[share[0]::share[1]]
    out = None if out_channels is None else torch.zeros((1, out_channels, side, side, side))
    for first in range(0, len(tiles), batch):
        group = tiles[first:first + batch]
        windows = torch.cat([x[:, :, i[2]:i[2] + window, j[2]:j[2] + window, k[2]:k[2] + window]
                             for i, j, k in group])
        pred = forward(windows).float().cpu()  # (b, C_out, W, W, W)
        if out is None:
            out = torch.zeros((1, pred.shape[1], side, side, side), dtype=torch.float32)
        for n, (i, j, k) in enumerate(group):
            core = tuple(slice(a - s, b - s) for a, b, s in (i, j, k))
            out[0, :, i[0]:i[1], j[0]:j[1], k[0]:k[1]] = pred[n][(slice(None),) + core]
        if progress is not None:
            progress(min(first + batch, len(tiles)), len(tiles))
    return out


def _volume(cfg, split: str) -> tuple[np.ndarray, np.ndarray, str]:
    """(Nbody (1, C_in, L, L, L), Hydro (1, C_out, L, L, L), where from) of ``split``: valid,
    train, or a file name under data_root."""
    files = {"valid": cfg.val_file, "train": cfg.train_file}
    volumes = None
    if cfg.data_is_generated:
        if split not in files:
            raise ConfigError(f"--split {split}: this run's volumes are generated in memory: "
                              f"choose valid or train")
        volumes = generated_data.cosmo_volumes(cfg, split)
        where = f"the generated {split} box"
    else:
        where = os.path.join(cfg.data_root, files.get(split, split))
        if split not in files and not os.path.isfile(where):
            raise ConfigError(f"--split {split}: neither valid, train nor a file under "
                              f"{cfg.data_root}: choose valid or train, or name a volume file")

    def crops(size):
        return CosmoCropDataset(where, size=size, nsamples=1, n_in=cfg.n_in_channels,
                                n_out=cfg.n_out_channels, augment=False, volumes=volumes)

    data = crops(crops(1).box)  # one crop: the whole box
    (sx, sy) = data.sample_shapes
    x, y = np.empty((1, *sx), np.float32), np.empty((1, *sy), np.float32)
    data.read_batch([0], x, y)  # the window at the corner 0 of the size of the box: all of it
    return x, y, where


def score(task, model, device: torch.device, autocast, opts) -> Report:
    """Predict the whole volume of ``opts.split`` tile by tile (score.py's options and ``rank``,
    ``world_size``: this rank's share of the tiles) and compute its statistics on rank 0 (the
    report; the other ranks None)."""
    cfg = task.cfg
    align = 2**model.levels
    x, y, where = _volume(cfg, opts.split)
    side = x.shape[-1]
    notes = []
    if side % align:
        cut = side // align * align
        if cut == 0:
            raise DataError(f"{where}: a box of side {side} is smaller than the U-Net's 2^levels="
                            f"{align}: score a larger volume")
        notes.append(f"note: the box side {side} is not a multiple of 2^levels={align}: the "
                     f"first {cut}^3 voxels are scored; the cut box is not periodic, so its "
                     f"power spectra gain power at high k from the cut edges")
        x, y = x[..., :cut, :cut, :cut], y[..., :cut, :cut, :cut]
        side = cut
    tile = min(opts.tile or cfg.data_size, side)
    halo = unet_halo(model.levels) if opts.halo is None else opts.halo
    if halo < unet_halo(model.levels):
        notes.append(f"note: --halo {halo} is less than {unet_halo(model.levels)}, the halo that "
                     f"makes the tiles exact: their seams may show")
    for line in notes:
        log.info(line)
    window = min(side, tile + 2 * halo)
    rank, world = opts.rank, opts.world_size
    n_tiles = len(tile_plan(side, tile, halo, align))**3
    shares = f", {len(range(rank, n_tiles, world))} of them on rank {rank} of {world}" if world > 1 else ""
    log.info(f"Predicting {where} ({side}^3 voxels) in {n_tiles} tiles of {tile}^3 voxels"
             f"{shares}, windows of {window}^3 (halo {halo})")
    t0 = time.monotonic()

    def progress(done, total):
        elapsed = time.monotonic() - t0
        log.info(f"Predicted {done}/{total} tiles{' of this rank' if world > 1 else ''}, "
                 f"ETA {duration(elapsed / done * (total - done))}")

    def forward(windows):
        with autocast():
            return model(windows.to(device))

    with torch.inference_mode():
        pred = predict_tiled(forward, torch.from_numpy(x), tile, halo, align, opts.batch_size or 1,
                             progress, share=(rank, world), out_channels=y.shape[1])
        if world > 1:
            # Each rank's tiles in a volume of zeros: their sum (one all-reduce) is the whole,
            # exactly. On the host (gloo), so that the device holds no more than a window;
            # a group with no host backend (nccl alone) takes it through the device.
            if dist.get_backend() == "nccl":
                pred = pred.to(device)
            dist.all_reduce(pred)
            pred = pred.cpu()
    if rank != 0:
        return None  # rank 0 computes the statistics
    log.info(f"Computing the spectra and distributions of {pred.shape[1]} channels")
    stats = [(spectra(p, t), histograms(p, t), field_errors(p, t)) for p, t in zip(pred[0].numpy(), y[0])]
    return _report(list(task.channels), stats, opts.split, where, side, tile, halo, notes)


def _report(channels, stats, split, where, side, tile, halo, notes) -> Report:
    rows, scalars = [], []
    for name, (spec, _, errors) in zip(channels, stats):
        for i, k in enumerate(spec["k"]):
            rows.append({"channel": name, "k": int(k), "modes": int(spec["modes"][i]),
                         "p_true": spec["p_true"][i], "p_pred": spec["p_pred"][i],
                         "p_ratio": spec["ratio"][i], "r": spec["r"][i], **errors})
            scalars += [(f"Spectrum/P_ratio({name})", float(spec["ratio"][i]), int(k)),
                        (f"Spectrum/r({name})", float(spec["r"][i]), int(k))]
        scalars += [(f"Field/{key}({name})", value, 0) for key, value in errors.items()]

    def figure(name, title, ylabel, series, xlabel="k (fundamental modes)", **scales):
        """One panel per channel, its lines ``series(spectra, histograms)``."""
        return Figure(name, title, [Panel(c, xlabel, ylabel, series(spec, hist), **scales)
                                    for c, (spec, hist, _) in zip(channels, stats)], columns=3)

    figures = [
        figure("power_spectra", "Power spectra P(k): truth and prediction",
               "P(k) ((stored units)^2 voxel^3)",
               lambda s, _: [("truth", s["k"], s["p_true"]), ("prediction", s["k"], s["p_pred"])],
               logx=True, logy=True),
        figure("spectrum_ratio", "P_pred(k) / P_true(k)", "ratio",
               lambda s, _: [("ratio", s["k"], s["ratio"])], logx=True, logy=True, hline=1.0),
        figure("cross_correlation", "Cross-correlation r(k) = P_xy / sqrt(P_xx P_yy)", "r(k)",
               lambda s, _: [("r", s["k"], s["r"])], logx=True, hline=1.0),
        figure("pdfs", "One-point distributions", "density",
               lambda _, h: [("truth", h["centres"], h["true"]),
                             ("prediction", h["centres"], h["pred"])],
               xlabel="value (stored units)", logy=True),
    ]
    summary = [f"Volume statistics of {where} ({side}^3 voxels, tiles of {tile}^3, halo {halo}):"]
    for name, (spec, _, e) in zip(channels, stats):
        quarter = max(0, len(spec["k"]) // 4 - 1)
        summary.append(f"  {name}: relative error {e['relative_error']:.4g}, bias {e['bias']:.3g} "
                       f"(mean {e['mean_true']:.4g} true, {e['mean_pred']:.4g} predicted); "
                       f"r(k) {spec['r'][0]:.3f} at k=1, {spec['r'][quarter]:.3f} at "
                       f"k={spec['k'][quarter]}, {spec['r'][-1]:.3f} at k={spec['k'][-1]}; "
                       f"P ratio {spec['ratio'][quarter]:.3g} at k={spec['k'][quarter]}")
    meta = {"problem": "volume statistics", "split": split, "volume": where, "side": side,
            "tile": tile, "halo": halo, "channels": channels}
    pdfs = [{"channel": name, "value": x, "density_true": p, "density_pred": q}
            for name, (_, h, _) in zip(channels, stats)
            for x, p, q in zip(h["centres"], h["true"], h["pred"])]
    return Report(rows, meta, scalars, figures, summary, notes, {"pdfs": pdfs})
