"""Forecast skill of the ERA5 ViT over lead time: autoregressive rollouts, each lead scored per
variable in physical units by latitude-weighted RMSE, ACC and zonal power spectra, beside
persistence and climatology, as docs/scoring.md defines them. ``SkillSums`` adds per-sample
scores up, so the means are exact however the initial conditions were batched or split over ranks.
"""
from __future__ import annotations

import functools
import glob
import itertools
import logging
import os
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from datapipe.era5_data import ERA5Dataset, load_stats
from observe.logging_utils import duration
from observe.score_report import Figure, Panel, Report
from settings.errors import ConfigError, DataError
from tasks.losses import weighted_rmse

log = logging.getLogger("score")

HOURS_PER_STEP = 6  # the stored fields are six-hourly
DEFAULT_LEAD_HOURS = 240  # ten days
HEADLINE = ("z500", "t850", "t2m", "u10m")  # the variables of the lead-time plots
FORECASTS = ("model", "persistence", "climatology")
SPLITS = ("valid", "train", "test")  # the usual splits under data_root, listed first
N_INIT = 32  # initial conditions scored when not told
SKILL_INITS = 8  # initial conditions of the rollouts made during training (skill_every)
# Physical units by the variable's name (its letters before the pressure level, or the name).
UNITS = {"u": "m/s", "v": "m/s", "t": "K", "z": "m^2/s^2", "sp": "Pa", "msl": "Pa", "r": "%",
         "tcwv": "kg/m^2", "u10m": "m/s", "v10m": "m/s", "t2m": "K"}


def units(name: str) -> str:
    """Physical units of an ERA5 variable (``z500`` -> m^2/s^2), or '' when unknown."""
    return UNITS.get(name) or UNITS.get(name.rstrip("0123456789"), "")


def power_units(name: str) -> str:
    """The units of a variable's power spectrum: its units squared (``t2m`` -> K^2)."""
    u = units(name)
    return f"({u})^2" if "/" in u or "^" in u else f"{u}^2" if u else ""


def acc(forecast: torch.Tensor, truth: torch.Tensor, clim: torch.Tensor,
        weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted anomaly correlation per sample and channel, as docs/scoring.md defines
    it: (B, C, H, W) -> (B, C); ``weights`` (H,) per row, ``clim`` (C, H, W). A forecast or truth
    with no anomaly anywhere (the climatology forecast) has no correlation: 0, not 0/0."""
    w = weights.to(forecast.device, torch.float64).view(1, 1, -1, 1)
    f = forecast.double() - clim.double()
    o = truth.double() - clim.double()
    num = (w * f * o).sum(dim=(2, 3))
    den = ((w * f * f).sum(dim=(2, 3)) * (w * o * o).sum(dim=(2, 3))).sqrt()
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny),
                       torch.zeros_like(num)).float()


def zonal_spectrum(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Zonal power spectra P(m) of fields (B, C, H, W), as docs/scoring.md defines them, over the
    rows' latitude ``weights`` (H,): (B, C, W // 2 + 1)."""
    f = torch.fft.rfft(x.double(), dim=-1)
    p = f.real ** 2 + f.imag ** 2
    p[..., 1:(x.shape[-1] + 1) // 2] *= 2  # the power of -m, folded onto m
    w = weights.to(x.device, torch.float64).view(1, 1, -1, 1)
    return (w * p).mean(dim=2) / x.shape[-1] ** 2


def small_scale_ratio(power: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """P ratio (docs/scoring.md): a forecast's power over the truth's in the upper half of the
    wavenumbers, spectra (..., M) -> (...); nan where the truth has no power there."""
    high = power[..., power.shape[-1] // 2 + 1:].sum(-1), truth[..., truth.shape[-1] // 2 + 1:].sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(high[1] > 0, high[0] / high[1], np.nan)


def rollout(step, x0: torch.Tensor, n_steps: int):
    """Yield (k, forecast k steps ahead) for k = 1..n_steps, each step's output the next step's
    input: ``step`` (B, C, H, W) -> (B, C, H, W) in the model's (normalised) units."""
    state = x0
    for k in range(1, n_steps + 1):
        state = step(state)
        yield k, state


class SkillSums:
    """Per-sample MSE (``rmse`` sqrt_after_time_avg) or RMSE (sqrt_before_time_avg), ACC and
    zonal power spectra of each forecast (and the truth's, last), summed over samples per lead
    and channel, of fields ``width`` wide."""

    def __init__(self, n_leads: int, n_channels: int, width: int, device="cpu",
                 rmse="sqrt_after_time_avg"):
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        self.sqrt_after = rmse != "sqrt_before_time_avg"
        shape = (len(FORECASTS), n_leads, n_channels)
        self.rmse, self.acc = zeros(shape), zeros(shape)
        self.power = zeros(len(FORECASTS) + 1, n_leads, n_channels, width // 2 + 1)
        self.count = zeros(n_leads)

    def add(self, forecast: str, lead: int, pred, truth, clim, weights):
        """Scores of a batch ``pred`` against ``truth`` (B, C, H, W, physical units) at ``lead``."""
        i = FORECASTS.index(forecast)
        rmse = weighted_rmse(pred, truth, weights).double()
        self.rmse[i, lead] += (rmse ** 2 if self.sqrt_after else rmse).sum(0)
        if clim is not None:
            self.acc[i, lead] += acc(pred, truth, clim, weights).double().sum(0)
        self.power[i, lead] += zonal_spectrum(pred, weights).sum(0)
        if i == 0:
            self.count[lead] += pred.shape[0]
            self.power[-1, lead] += zonal_spectrum(truth, weights).sum(0)

    def reduce(self):
        """Add up the sums of all ranks, on every rank (nothing to do in one process)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            # one all-reduce of each sum: the means of one process scoring every initial condition
            for t in (self.rmse, self.acc, self.power, self.count):
                dist.all_reduce(t)

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(RMSE, ACC) over the samples, (forecasts, leads, channels) float64 arrays, and the
        mean power spectra (forecasts and truth, leads, channels, wavenumbers)."""
        n = self.count.clamp_min(1).view(1, -1, 1)
        rmse = self.rmse / n
        return ((rmse.sqrt() if self.sqrt_after else rmse).cpu().numpy(),
                (self.acc / n).cpu().numpy(), (self.power / n[..., None]).cpu().numpy())


def lead_steps_for(year_steps: list[int], dt: int, wanted: int | None,
                   n_init: int | None, fit: bool = False) -> tuple[int, int, str]:
    """(model steps of the rollout, initial conditions, a note or ''), from the ``wanted`` steps
    and ``n_init`` (None: the defaults) as docs/scoring.md says; beyond the split's, refused,
    or with ``fit`` (during training, ``skill_every``) cut to what the split gives."""
    def starts(n: int) -> int:  # the split's initial conditions of n-step rollouts
        return sum(max(0, steps - n * dt) for steps in year_steps)

    if starts(1) < 1:
        raise DataError(f"the split's years hold {max(year_steps)} steps, fewer than one forecast "
                        f"step (dt={dt}) and its target: score another --split")
    hours = dt * HOURS_PER_STEP
    if fit:  # the longest lead any year gives, then the initial conditions that lead has
        wanted = min(wanted, max(n for n in range(1, max(year_steps)) if starts(n) >= 1))
        n_init = min(n_init, starts(wanted))
    if n_init is not None and n_init > starts(1):
        raise ConfigError(f"--n_init {n_init}: the split's years hold {starts(1)} initial "
                          f"conditions of a {hours} h forecast: give --n_init {starts(1)} or fewer")
    n_init = n_init or min(N_INIT, starts(1))
    most = max(n for n in range(1, max(year_steps)) if starts(n) >= n_init)
    if wanted is not None and wanted > most:
        raise ConfigError(f"--lead_steps {wanted}: the split's years give {n_init} initial "
                          f"conditions for at most {most} lead steps ({most * hours} h): give "
                          f"--lead_steps {most} or fewer, or a smaller --n_init")
    n = wanted or max(1, DEFAULT_LEAD_HOURS // hours)
    if n > most:
        return most, n_init, (f"note: the split's years give {n_init} initial conditions for at "
                              f"most {most} lead steps ({most * hours} h): {most} instead of {n}")
    return n, n_init, ""


def initial_conditions(year_steps: list[int], span: int, n: int) -> list[tuple[int, int]]:
    """Up to ``n`` (year index, step) starts spread evenly through the split, each followed by
    ``span`` steps in its year; in order."""
    starts = [(k, t) for k, steps in enumerate(year_steps) for t in range(steps - span)]
    pick = np.unique(np.linspace(0, len(starts) - 1, min(n, len(starts))).round().astype(int))
    return [starts[i] for i in pick]


def split_directory(data_root: str, split: str) -> str:
    """``<data_root>/<split>``, where the split's year files are. A split without any, where
    data_root holds other splits, is refused with their names (where it holds none, the data is
    elsewhere, and the dataset's refusal says to set data_root)."""
    directory = os.path.join(data_root, split)
    if glob.glob(os.path.join(directory, "*.h5")) or not os.path.isdir(data_root):
        return directory
    held = [d for d in os.listdir(data_root) if glob.glob(os.path.join(data_root, d, "*.h5"))]
    held.sort(key=lambda d: (SPLITS.index(d) if d in SPLITS else len(SPLITS), d))
    if not held:
        return directory
    raise ConfigError(f"--split {split}: no ERA5 year files (*.h5) in {directory}: choose one "
                      f"of {', '.join(held)}")


def load_climatology(data_root: str, n_channels: int, img_size, device) -> torch.Tensor | None:
    """``<data_root>/stats/time_means.npy`` (1, C, H, W) as (n_channels, h, w) float32 on ``device``,
    cropped to ``img_size``; None when the file is absent. A file of the wrong shape is refused."""
    path = os.path.join(data_root, "stats", "time_means.npy")
    if not os.path.exists(path):
        return None
    try:
        a = np.load(path)
    except Exception as e:  # numpy's parse of a damaged header raises many kinds
        raise DataError(f"{path} is not a readable .npy array ({type(e).__name__}): write it "
                        f"again with numpy.save, or remove it to score without ACC") from None
    h, w = img_size
    if a.ndim != 4 or a.shape[0] != 1 or a.shape[1] < n_channels or a.shape[2] < h or a.shape[3] < w:
        raise DataError(f"{path} has shape {a.shape}; expected (1, C, H, W) with C >= {n_channels}, "
                        f"H >= {h}, W >= {w}: write it again, or remove it to score without ACC")
    return torch.from_numpy(np.ascontiguousarray(a[0, :n_channels, :h, :w], dtype=np.float32)).to(device)


def training_skill(task, model, device: torch.device, forward, rank: int = 0,
                   world: int = 1) -> tuple[dict, list[str]]:
    """The skill of a model being trained (``skill_every``, docs/scoring.md): ``score``'s numbers
    for ``SKILL_INITS`` initial conditions of the validation years. Returns the TensorBoard
    scalars (the model's RMSE and ACC of every variable at the last lead) and the summary."""
    opts = SimpleNamespace(split="valid", lead_steps=task.cfg.skill_lead_steps, n_init=SKILL_INITS,
                           batch_size=None, rmse=None, rank=rank, world_size=world, fit=True)
    report = score(task, model, device, forward, opts)
    last = report.meta["lead_steps"]
    hours = last * report.meta["hours_per_step"]
    scalars = {f"Skill/{label}({row['variable']}) at {hours} h": row[label.lower()]
               for row in report.rows if row["forecast"] == "model" and row["lead_step"] == last
               for label in ("RMSE", "ACC") if row[label.lower()] is not None}
    return scalars, report.summary


def score(task, model, device: torch.device, autocast, opts) -> Report:
    """Roll ``model`` out from initial conditions spread through ``opts.split`` (score.py's options
    and ``rank``, ``world_size``: this rank's share of them) and score every lead time."""
    cfg = task.cfg
    if cfg.data_is_generated:
        raise ConfigError("this run's ERA5 batches were generated in memory (data_loader_config "
                          "synthetic), so there are no stored years to roll out through: score "
                          "with --data_root DIR of ERA5 files (python -m datapipe.synthetic era5 "
                          "--out DIR makes some)")
    directory = split_directory(cfg.data_root, opts.split)
    data = ERA5Dataset(directory, cfg.data_root, cfg.img_size, dt=1, n_in=cfg.n_in_channels,
                       n_out=cfg.n_out_channels)
    year_steps = [n + 1 for n in data.pairs_per_file]
    n_steps, n_init, note = lead_steps_for(year_steps, cfg.dt, opts.lead_steps, opts.n_init,
                                           fit=getattr(opts, "fit", False))
    if n_steps > 1 and cfg.n_in_channels != cfg.n_out_channels:
        n_steps, note = 1, (f"note: the model reads {cfg.n_in_channels} channels and writes "
                            f"{cfg.n_out_channels}, so its output cannot be its next input: one lead step")
    notes = [note] if note else []
    if data.file_rows > cfg.img_size[0] + 1:  # (the tutorial's crop drops one row: the south pole)
        notes.append(f"note: the data's fields have {data.file_rows} rows and img_size keeps the first "
                     f"{cfg.img_size[0]}; the latitude weights take those rows to run from pole to pole (as "
                     f"the tutorial's metric does), so they weight rows as at other latitudes than theirs: "
                     f"these scores do not compare with whole-globe ones")
    starts = initial_conditions(year_steps, n_steps * cfg.dt, n_init)
    rank, world = opts.rank, opts.world_size
    mine = starts[rank::world]
    batch_size = opts.batch_size or 8
    c_out = cfg.n_out_channels
    mean, std = (torch.from_numpy(a).to(device)  # (C, 1, 1)
                 for a in load_stats(cfg.data_root, max(cfg.n_in_channels, c_out)))
    clim = load_climatology(cfg.data_root, c_out, cfg.img_size, device)
    if clim is None:
        notes.append(f"note: {cfg.data_root}/stats/time_means.npy is missing: no climatology, so "
                     f"no ACC and no climatology forecast")
    shown = [f for f, on in zip(FORECASTS, (True, cfg.n_in_channels >= c_out, clim is not None)) if on]
    weights = task.weights.to(device)
    (c_in, h, w), _ = data.sample_shapes
    rmse_name = opts.rmse or "sqrt_after_time_avg"  # score.py's RMSE
    sums = SkillSums(n_steps + 1, c_out, w, device, rmse_name)
    scratch_in, scratch_out = np.empty((1, c_in, h, w), np.float32), np.empty((1, c_out, h, w), np.float32)

    def stored(batch, lead):
        """The stored states ``lead`` steps after each start of ``batch``, on the device: at lead
        0 the input of the pair (t, t + 1), its inputs' channels; after it the target of the pair
        (t + lead - 1, t + lead), its outputs' channels."""
        out = np.empty((len(batch), c_out if lead else c_in, h, w), np.float32)
        for j, (k, t) in enumerate(batch):
            x, y = (scratch_in, out[j:j + 1]) if lead else (out[j:j + 1], scratch_out)
            data.read_batch([int(data.offsets[k]) + t + max(lead - 1, 0)], x, y)
        out = torch.from_numpy(out)  # to a GPU from pinned memory, queued (docs/scoring.md, Speed)
        return out.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else out

    def step(state):
        with autocast():
            return model(state).float()

    for line in notes:
        log.info(line)
    shares = f", {len(mine)} of them on rank {rank} of {world}" if world > 1 else ""
    log.info(f"Scoring {len(starts)} initial conditions of {directory}{shares}, {n_steps} lead "
             f"steps of {cfg.dt * HOURS_PER_STEP} h, batches of {batch_size}")
    t0, done = time.monotonic(), 0
    with torch.inference_mode():
        for b in range(0, len(mine), batch_size):
            batch = mine[b:b + batch_size]
            x0 = stored(batch, 0)
            truth0 = x0[:, :c_out]  # lead 0: the model's and persistence's forecast
            forecasts = rollout(step, (x0 - mean[:c_in]) / std[:c_in], n_steps)
            for k, pred_n in itertools.chain([(0, None)], forecasts):
                truth = stored(batch, k * cfg.dt) if k else truth0
                pred = pred_n * std[:c_out] + mean[:c_out] if k else truth0
                made = {"model": pred, "persistence": truth0, "climatology": clim}
                for f in shown:  # the climatology's ACC is 0 by definition: not computed, left 0
                    sums.add(f, k, made[f].expand_as(truth), truth,
                             None if f == "climatology" else clim, weights)
            done += len(batch)
            elapsed = time.monotonic() - t0
            log.info(f"Scored {done}/{len(mine)} initial conditions{' of this rank' if world > 1 else ''}: "
                     f"{done * n_steps / elapsed:.1f} forecast steps/s, "
                     f"ETA {duration(elapsed / done * (len(mine) - done))}")
    sums.reduce()
    rmse, accs, power = sums.means()
    return _report(task, rmse, accs, power, n_steps, len(starts), opts.split, notes, rmse_name, shown)


def _report(task, rmse, accs, power, n_steps, n_init, split, notes, rmse_name, shown) -> Report:
    """The tables (the scores, and the spectra's), plots, TensorBoard scalars and summary of the
    forecasts ``shown``."""
    cfg = task.cfg
    channels = list(task.channels)
    hours = [k * cfg.dt * HOURS_PER_STEP for k in range(n_steps + 1)]
    varying = [f for f in shown if f != "climatology"]  # climatology's ACC and P ratio are flat
    ratio = small_scale_ratio(power[:-1], power[-1:])
    with_acc = "climatology" in shown
    rows = [{"forecast": forecast, "variable": name, "units": units(name), "lead_step": k,
             "lead_hours": hour, "rmse": float(rmse[i, k, c]),
             "acc": float(accs[i, k, c]) if with_acc else None, "p_ratio": float(ratio[i, k, c])}
            for i, forecast in enumerate(FORECASTS) if forecast in shown
            for c, name in enumerate(channels) for k, hour in enumerate(hours)]
    # column: label, means, title, the forecasts drawn
    metrics = {"rmse": ("RMSE", rmse, "Latitude-weighted RMSE", shown)}
    if with_acc:
        metrics["acc"] = ("ACC", accs, "Anomaly correlation", varying)
    metrics["p_ratio"] = ("P_ratio", ratio, "Forecast / truth power at the smallest scales",
                          varying)
    scalars = [(f"Skill/{label}({row['variable']})/{row['forecast']}", row[key], row["lead_hours"])
               for key, (label, _, _, drawn) in metrics.items() for row in rows
               if row["forecast"] in drawn]
    xstep = 24 * max(1, round(hours[-1] / 240))

    def panel(c, label, values, drawn):
        unit = f" ({units(channels[c])})" if label == "RMSE" and units(channels[c]) else ""
        return Panel(title=channels[c], xlabel="lead time (h)", ylabel=f"{label}{unit}",
                     series=[(f, hours, values[FORECASTS.index(f), :, c]) for f in drawn],
                     logy=label == "P_ratio", hline=1.0 if label == "P_ratio" else None,
                     xstep=xstep)

    headline = [channels.index(n) for n in HEADLINE if n in channels]
    figures = [Figure(f"{key}_{which}", f"{title} {what}",
                      [panel(c, label, values, drawn) for c in cs], columns)
               for which, what, cs, columns in (("headline", "against lead time", headline, 2),
                                                ("all", "of every variable", range(len(channels)), 5))
               for key, (label, values, title, drawn) in metrics.items()]
    leads = sorted({k for k in (1, 24 // (cfg.dt * HOURS_PER_STEP), n_steps // 2, n_steps)
                    if 1 <= k <= n_steps})
    m = np.arange(power.shape[-1])
    figures.append(Figure("spectra_headline", "Zonal power spectra", [
        Panel(channels[c], "zonal wavenumber", f"P(m) ({power_units(channels[c])})",
              [(f"{f} {hours[k]} h", m[1:], power[i, k, c, 1:])  # m = 0 is off the log axis
               for f, i, ks in (("truth", -1, [n_steps]), ("persistence", 1, [n_steps]),
                                ("model", 0, leads)) if f in ("truth", *varying) for k in ks],
              logx=True, logy=True) for c in headline]))
    kept = [k for k in range(n_steps + 1) if k in leads or hours[k] % 24 == 0]
    spectra = [{"forecast": f, "variable": name, "power_units": power_units(name), "lead_step": k,
                "lead_hours": hours[k], "wavenumber": int(j), "power": float(power[i, k, c, j])}
               for i, f in enumerate((*FORECASTS, "truth")) if f in (*shown, "truth")
               for c, name in enumerate(channels) for k in kept for j in m]
    summary = [f"Forecast skill on {split}: {n_init} initial conditions, {n_steps} lead steps ({hours[-1]} h)"]
    for c in headline or range(min(4, len(channels))):
        parts = []
        for k in leads:
            values = " / ".join(f"{rmse[FORECASTS.index(f), k, c]:.4g}" for f in shown)
            score_acc = f", model ACC {accs[0, k, c]:.3f}" if with_acc else ""
            parts.append(f"{hours[k]} h {values}{score_acc}, P ratio {ratio[0, k, c]:.3g}")
        summary.append(f"  {channels[c]} RMSE ({units(channels[c])}), "
                       f"{' / '.join(shown)}: " + "; ".join(parts))
    meta = {"problem": "forecast skill", "split": split, "initial_conditions": n_init,
            "lead_steps": n_steps, "hours_per_step": cfg.dt * HOURS_PER_STEP,
            "forecasts": shown, "acc": with_acc, "rmse": rmse_name,
            "p_ratio_wavenumbers": [len(m) // 2 + 1, len(m) - 1]}
    return Report(rows, meta, scalars, figures, summary, notes, {"spectra": spectra})
