"""Model-parallel ViT training: tensor (tp) x context (cp) x data (dp) parallel ranks.

    torchrun --nproc_per_node 4 train_mp.py --tensor_parallel 2 --context_parallel 2
    sbatch -N 4 submit_pm.sh ... (SCRIPT=train_mp.py) --config mp --tensor_parallel 4

The same engine as train.py. Each model replica spans tensor_parallel x context_parallel ranks
(attention heads and MLP width split over tp, image rows over cp; docs/parallelism.md, "How
model parallelism works"); the remaining world / (tp x cp) ranks are data parallel. Checkpoints
are written in the serial layout and load on any layout.
"""
import sys

from settings.cli import from_argv
from settings.errors import refuse


def main(argv):
    cfg = from_argv(argv, prog="train_mp.py")  # bad settings and --help: before torch loads
    from tasks import make_task
    from train import run
    if not make_task(cfg).shards_model:
        refuse(f"train_mp.py shards the ViT; config '{cfg.name}' is a {cfg.model} config: use "
               f"train.py for it (data parallel)")
    run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
