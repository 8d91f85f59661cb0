"""Turn a sharded checkpoint (a ``ckpt_<step>.dcp`` directory an FSDP run wrote with torch's
distributed checkpoint) into one ``.pt`` file of the single-file format: the whole weights and
Adam state in the serial layout, keyed by parameter name, with the step, schedule, RNG streams
and config. The file resumes any run (``--resume_from``) and serves inference or sharing
(``torch.load(path, weights_only=True)["model"]`` is the model's state dict).

    python -m engine.checkpoint_convert logs/ViT/quickstart/4/0/checkpoints/ckpt_00000100.dcp ckpt.pt

Runs in one process on a CPU and reads every shard: it needs memory for the whole model and its
optimizer state. Bad input (a SRC that is no sharded checkpoint, an OUT that exists already:
never overwritten) is one ``error:`` line and exit code 2, and nothing is written.
"""
from __future__ import annotations

from engine.checkpoint import CheckpointException, convert, state_nbytes
from settings.errors import OneLineParser, refuse


def main(argv=None):
    parser = OneLineParser(prog="python -m engine.checkpoint_convert",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a ckpt_<step>.dcp directory, or a checkpoints directory "
                                    "(its newest sharded checkpoint)")
    parser.add_argument("out", help="the .pt file to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        whole = convert(args.src, args.out)
    except (ValueError, OSError, CheckpointException) as e:
        refuse(str(e))
    n = sum(t.numel() for t in whole["model"].values())
    print(f"{args.out}: step {whole['iteration']}, {n / 1e6:.3g} M parameters, "
          f"{state_nbytes(whole) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
