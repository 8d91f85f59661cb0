"""Train a ViT on ERA5 or a 3D U-Net on cosmology volumes from a named YAML config.

    python train.py                                   # ViT quickstart on synthetic data (CPU ok)
    python train.py --yaml_config config/UNet.yaml --config quickstart
    python train.py --config short --num_data_workers 8 --amp_mode bf16
    torchrun --nproc_per_node 4 train.py --config bs64_opt

Data parallel over every rank the launcher starts; tensor/context parallel when the config's
tensor_parallel/context_parallel are above 1 (see train_mp.py).
"""
import logging
import os
import sys

from utils.config import from_argv
from utils.errors import UserError
from utils.parallel import describe_dist_failure, setup_runtime
from utils.trainer import Trainer

DEFAULT_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", "ViT.yaml")


def _fail(rt, message, exit_code, trainer=None, broken_group=False):
    """End the process with one line on stderr (and in the run's out.log, on rank 0).

    ``broken_group``: a collective failed (a peer died or hangs). The process group cannot be
    shut down cleanly then (gloo's destructors may abort the process while a peer is still
    connected), so the logs and TensorBoard events are flushed and the process exits at once.
    """
    prefix = f"[rank {rt.rank}] " if rt is not None and rt.distributed else ""
    record = logging.LogRecord("train", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:  # keep the reason in the run's out.log
        if isinstance(handler, logging.FileHandler):
            handler.emit(record)
    print(f"{prefix}error: {message}", file=sys.stderr)
    if broken_group:
        if trainer is not None:
            trainer.board.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    raise SystemExit(exit_code)


def run(cfg, trainer_cls=Trainer):
    """Set up the runtime and train; user errors and failed collectives (a dead or hung peer
    rank) end the process with one line and a non-zero exit code."""
    rt = trainer = None
    try:
        rt = setup_runtime(cfg)
        trainer = trainer_cls(cfg, rt)
        trainer.fit()
    except UserError as e:
        _fail(rt, str(e), e.exit_code)
    except RuntimeError as e:  # includes torch.distributed.DistError
        where = f"after step {trainer.iteration}" if trainer is not None else "during set-up"
        message = describe_dist_failure(e, cfg, where)
        if message is None:
            raise  # a bug, not a peer's failure: keep the traceback
        _fail(rt, message, 1, trainer, broken_group=True)
    finally:
        if rt is not None:
            rt.shutdown()


if __name__ == "__main__":
    run(from_argv(sys.argv[1:], DEFAULT_YAML))
