"""Score a trained model as its science judges it, from its run directory or a checkpoint.

The ViT's forecast skill over lead time (``tasks.forecast_skill``), the U-Net's statistics of a
whole predicted volume (``tasks.volume_stats``). docs/scoring.md has the commands, says what is
read, what is written, how ranks share the work, and defines every number.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import typing

from settings.config import Config, field_types
from settings.errors import ConfigError, OneLineParser, UserError, at_least, print_error, refuse

CHOICES = {k: typing.get_args(field_types(Config)[k]) for k in ("device", "amp_mode")}
# The model's name and the options only its scoring reads (default None): refused for the other's runs.
MODEL_OPTIONS = {"vit": ("ViT", ("lead_steps", "n_init", "rmse")), "unet": ("U-Net", ("tile", "halo"))}
RMSE = ("sqrt_after_time_avg", "sqrt_before_time_avg")  # WeatherBench 2's RMSE first, the default


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python score.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True,
                   help="a run directory (its newest loadable checkpoint is scored) or one "
                        "checkpoint: a ckpt_<step>.pt file or ckpt_<step>.dcp directory")
    p.add_argument("--split", default="valid",
                   help="the data to score on: valid (default), train, test (ViT: a directory "
                        "under data_root; U-Net: valid, train or a volume file under data_root)")
    p.add_argument("--out", default=None,
                   help="directory to write the scores into (default <run dir>/score); it must not exist yet")
    p.add_argument("--lead_steps", type=at_least(1), default=None,
                   help="ViT: forecast steps of each rollout (default: 10 days of the model's "
                        "dt x 6 h steps, fewer where the split's years are shorter)")
    p.add_argument("--n_init", type=at_least(1), default=None,
                   help="ViT: initial conditions, spread evenly through the split (default 32)")
    p.add_argument("--rmse", choices=RMSE, default=None,
                   help="ViT: sqrt_after_time_avg (default, WeatherBench 2's RMSE: the square "
                        "root of the mean over initial times of the MSE) or sqrt_before_time_avg "
                        "(the mean of each initial time's RMSE)")
    p.add_argument("--batch_size", type=at_least(1), default=None,
                   help="initial conditions (ViT, default 8) or tile windows (U-Net, default 1) per forward pass")
    p.add_argument("--tile", type=at_least(1), default=None,
                   help="U-Net: side in voxels of the tiles the volume is predicted in (default "
                        "the training crop side, data_size); a multiple of 2^levels")
    p.add_argument("--halo", type=at_least(0), default=None,
                   help="U-Net: voxels of context around each tile (default: the smallest with which the tiles "
                        "stitch into exactly one whole-volume forward, 64 for 5 levels, 128 for 6; less bounds "
                        "memory, but seams may show); a multiple of 2^levels")
    p.add_argument("--data_root", default=None,
                   help="read the data from here instead of the run's data_root")
    p.add_argument("--device", choices=CHOICES["device"], default=None,
                   help="where the model runs (default: the run's device setting)")
    p.add_argument("--amp_mode", choices=CHOICES["amp_mode"], default=None,
                   help="mixed precision of the forward passes (default: the run's amp_mode)")
    return p


def missing_run(path: str) -> str:
    """The refusal of a ``--run`` that does not exist."""
    return (f"--run {path}: no such run directory or checkpoint: give a run directory "
            f"(<expdir>/<config>/<world size>/<run>) or a checkpoint (ckpt_<step>.pt or ckpt_<step>.dcp)")


def read_command_line(argv) -> argparse.Namespace:
    """The options, refused in one line before torch loads. A missing ``--run`` is refused here
    only in one process: ranks refuse it together (``agree``), as it may exist on some nodes."""
    args = parser().parse_args(argv)
    if os.environ.get("WORLD_SIZE", "1") == "1" and not os.path.exists(args.run):
        refuse(missing_run(args.run))
    return args


if __name__ == "__main__":  # bad options and --help are answered before torch loads
    COMMAND_LINE = read_command_line(sys.argv[1:])

import torch  # from here on: torch and the engine (seconds to load)
import torch.distributed as dist
import yaml

from engine import checkpoint
from engine.runtime import AMP_DTYPES, _env_int, check_amp, choose_device
from observe.logging_utils import setup_logging
from observe.score_report import NO_PLOTS, write_report
from settings.config import CONFIG_CLASSES, check_dir, validate
from settings.parse import build_config, yaml_problem
from tasks import make_task

log = logging.getLogger("score")


def find_checkpoint(path: str) -> tuple[dict, str, str]:
    """(checkpoint state, its path, the run directory) for ``--run``: a run directory (its
    newest loadable checkpoint) or a checkpoint file or DCP directory."""
    if not os.path.exists(path):
        raise ConfigError(missing_run(path))
    if os.path.isdir(path) and not checkpoint.is_sharded(path):
        run_dir, folder = path, os.path.join(path, "checkpoints")
        inside = os.path.abspath(path)
        if os.path.basename(inside) == "checkpoints" and not os.path.isdir(folder):
            run_dir, folder = os.path.dirname(inside), path  # <run>/checkpoints: its run
        state, found = checkpoint.load_latest(folder)
        if state is None:
            raise ConfigError(f"--run {path}: no loadable checkpoint in {folder}: train the run "
                              f"first, or give a checkpoint of it")
        return state, found, run_dir
    state, found = checkpoint.load_file(path)
    if state is None:
        raise ConfigError(f"--run {path} is not a loadable checkpoint (the warning above says "
                          f"why): give another checkpoint, or the run directory")
    parent = os.path.dirname(os.path.abspath(path.rstrip(os.sep)))
    run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    return state, found, run_dir


def run_config(run_dir: str, state: dict, overrides: dict):
    """The run's resolved config: ``<run_dir>/config.yaml``, else the one saved in the
    checkpoint; with ``overrides`` (data_root, device, amp_mode) applied."""
    path = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(path):
        name = config_name(path)
        try:
            return build_config(path, name, {k: str(v) for k, v in overrides.items()})
        except ConfigError:
            try:  # the file's own fault, or the command line's (e.g. --data_root)?
                build_config(path, name)
            except ConfigError as own:  # its message need not say which file it is in
                raise (own if path in str(own) else
                       ConfigError(f"{path}, the run's config: {own}")) from None
            raise
    saved = dict(state["config"])
    cls = CONFIG_CLASSES.get(str(saved.get("model")))
    if cls is None:
        raise ConfigError(f"the checkpoint's config names model={saved.get('model')!r}, not one "
                          f"of {', '.join(CONFIG_CLASSES)}")
    known = {f.name for f in dataclasses.fields(cls)}
    cfg = cls(**{k: v for k, v in saved.items() if k in known} | overrides)
    validate(cfg)
    return cfg


def config_name(path: str) -> str:
    """The name of the one config a run's ``config.yaml`` holds. A damaged file is refused here,
    naming it: the settings' own reader would name --yaml_config, which score.py has not."""
    fix = "restore it, or move it out of the run directory to score with the config saved in the checkpoint"
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e)
        raise ConfigError(f"{path}, the run's config, cannot be read ({reason}): {fix}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}, the run's config, is not valid YAML ({yaml_problem(e)}): {fix}") from None
    if not (isinstance(doc, dict) and len(doc) == 1 and isinstance(next(iter(doc)), str)
            and isinstance(next(iter(doc.values())), dict)):
        raise ConfigError(f"{path}, the run's config, does not hold one config (its name, and "
                          f"below it the settings): {fix}")
    return next(iter(doc))


def check_model_options(args, cfg, run: str):
    """Refuse the options given for the other model's scoring, which would be ignored."""
    for model, (label, names) in MODEL_OPTIONS.items():
        given = [n for n in names if getattr(args, n) is not None]
        if given and model != cfg.model:
            other = MODEL_OPTIONS.get(cfg.model, (cfg.model,))[0]
            raise ConfigError(f"--{given[0]} {getattr(args, given[0])} is an option of the {label}'s "
                              f"scoring, and {run} is a {other} run: drop --{given[0]}")


def load_weights(model: torch.nn.Module, state: dict, path: str, cfg):
    """The checkpoint's weights in the serial layout into ``model``; a checkpoint of the other
    model, or another mismatch, is refused."""
    saved = state.get("config", {}).get("model", cfg.model)
    if saved != cfg.model:
        name = {m: label for m, (label, _) in MODEL_OPTIONS.items()}
        raise ConfigError(f"{path} is a {name.get(saved, saved)} checkpoint given to a "
                          f"{name.get(cfg.model, cfg.model)} run: score it with its own run directory")
    try:
        model.load_state_dict(checkpoint.weights(state))
    except RuntimeError as e:
        reason = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise ConfigError(f"{path}: its weights do not fit the model its config builds "
                          f"({reason[:200]}): score it with its own run's config") from None


def output_dir(out: str | None, run_dir: str) -> str:
    """Where the scores go; refused when it exists already (scores are never written over)."""
    out = out or os.path.join(run_dir, "score")
    if os.path.exists(out):
        raise ConfigError(f"{out} exists already, and scores are never written over: remove it, or give --out DIR")
    check_dir("--out", os.path.dirname(os.path.abspath(out)), writable=True)
    return out


def ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank): the running process group's, else the environment's that
    torchrun or export_DDP_vars.sh (Slurm) sets; (0, 1, 0) without either."""
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), local_rank


def join_ranks(world: int, rank: int) -> bool:
    """Join the default process group of ``world`` ranks unless one runs already (the caller's);
    whether this call made it. The same checks on every rank, before any rank waits for another."""
    if world <= 1 or dist.is_initialized():
        return False
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ConfigError(f"WORLD_SIZE={world} but {var} is not set: launch with torchrun, or "
                              f"source export_DDP_vars.sh in the job script")
    # gloo for host tensors (the ranks' agreement, the U-Net's volume), nccl for the ViT's GPU sums
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return True


@contextlib.contextmanager
def agreed(world: int):
    """Run the block on every rank, then raise on every rank when any rank's block failed: a
    rank's own error there; elsewhere the first failing rank's user error (prefixed with that rank
    unless it is rank 0), or a one-line pointer to that rank's traceback."""
    error = None
    try:
        yield
    except Exception as e:
        error = e
    if world > 1:  # collective, also the ranks' barrier: none is left waiting in the next one
        told = [None] * world
        mine = None if error is None else (error if isinstance(error, UserError) else
                                           UserError(f"{type(error).__name__}: {error}"))
        dist.all_gather_object(told, mine)
        failed = [(r, e) for r, e in enumerate(told) if e is not None]
        if error is None and failed:
            r, first = failed[0]
            raise first if r == 0 else type(first)(f"rank {r}: {first}")
    if error is not None:
        raise error


def score(args) -> str | None:
    """Score the run ``args.run`` as its task does and write the report; its directory (None on
    ranks other than 0, which write nothing)."""
    rank, world, local_rank = ranks()
    with contextlib.ExitStack() as group:
        if join_ranks(world, rank):
            group.callback(dist.destroy_process_group)
        with agreed(world):  # the checkpoint, the output directory, the config, the model
            state, ckpt, run_dir = find_checkpoint(args.run)
            out = output_dir(args.out, run_dir) if rank == 0 else None  # only rank 0 writes
            overrides = {k: getattr(args, k) for k in ("data_root", "device", "amp_mode")
                         if getattr(args, k) is not None}
            cfg = run_config(run_dir, state, overrides)
            check_model_options(args, cfg, args.run)
            device = choose_device(cfg, local_rank)
            check_amp(cfg, device)
            task = make_task(cfg)
            model = task.build_model()
            load_weights(model, state, ckpt, cfg)
            model.to(device).eval()
        amp = AMP_DTYPES[cfg.amp_mode]
        kernels = task.forward_kernels(device, amp or torch.float32)

        @contextlib.contextmanager
        def autocast():  # the forwards' context: autocast and the task's kernels, as in training
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None), kernels():
                yield

        on = f"{world} ranks ({device} on rank 0)" if world > 1 else str(device)
        log.info(f"Scoring {ckpt} (step {state['iteration']}) on {on}, amp_mode {cfg.amp_mode}")
        # The task's own checks of the data come before its collectives, and are the same on every
        # rank (the same files and options), so that all ranks refuse together.
        report = task.score(model, device, autocast, argparse.Namespace(**vars(args), rank=rank,
                                                                        world_size=world))
        with agreed(world):  # every rank waits for rank 0's report
            if rank == 0:
                report.meta.update(checkpoint=os.path.abspath(ckpt), step=int(state["iteration"]),
                                   device=str(device), amp_mode=cfg.amp_mode, ranks=world)
                tmp = f"{out}.{os.getpid()}.tmp"  # written whole, then renamed into place
                try:
                    written = write_report(report, tmp)
                    os.rename(tmp, out)
                finally:
                    if os.path.exists(tmp):
                        shutil.rmtree(tmp)
    if rank != 0:
        return None
    for line in report.summary:
        log.info(line)
    log.info(f"Scores written to {out}: {', '.join(written)}")
    if NO_PLOTS in report.notes:
        log.info(NO_PLOTS)
    log.info(f"  Look at them: tensorboard --logdir {out}")
    return out


def main(argv=None, args=None):
    """Score as the command line ``argv`` says (or its ``args``, already read)."""
    args = args if args is not None else read_command_line(argv)
    rank = 0
    with contextlib.suppress(UserError):  # a bad RANK or WORLD_SIZE is refused in score()
        rank = ranks()[0]
    setup_logging(rank)  # progress from rank 0, warnings from every rank
    try:
        score(args)
    except UserError as e:
        if rank == 0:  # every rank stops with the same code; rank 0 says why, once
            print_error(str(e))
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    main(args=COMMAND_LINE)
