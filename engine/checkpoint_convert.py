"""Turn a sharded checkpoint (a ``ckpt_<step>.dcp`` directory an FSDP run wrote with torch's
distributed checkpoint) into one ``.pt`` file of the single-file format: the whole weights and
Adam state in the serial layout, keyed by parameter name, with the step, schedule, RNG streams
and config. The file resumes any run (``--resume_from``) and serves inference or sharing
(``torch.load(path, weights_only=True)["model"]`` is the model's state dict).

One process on a CPU, reading every shard: it needs memory for the whole model and Adam state."""
from __future__ import annotations

import os

from engine.checkpoint.files import (CheckpointException, is_sharded, list_checkpoints,
                                     load_file, read_tensors, state_nbytes, write_file)
from settings.errors import OneLineParser, refuse


def convert(src: str, out: str) -> dict:
    """Write the DCP checkpoint ``src`` (or a directory's newest) as one new file ``out``."""
    if not os.path.exists(src):
        raise ValueError(f"{src} does not exist: give a ckpt_<step>.dcp directory or a "
                         f"checkpoints directory")
    if os.path.lexists(out):
        raise ValueError(f"{out} exists: choose another name for the output, or remove it")
    if os.path.isdir(src) and not is_sharded(src):
        found = [p for p in list_checkpoints(src) if os.path.isdir(p)]
        if not found:
            raise ValueError(f"{src} holds no sharded checkpoint (ckpt_<step>.dcp): give one")
        src = found[0]
    if not os.path.isdir(src):
        raise ValueError(f"{src} is not a sharded checkpoint directory (ckpt_<step>.dcp); a .pt "
                         f"checkpoint is a single file already")
    state, path = load_file(src)
    if state is None:
        raise ValueError(f"{src} does not load (incomplete or corrupt; the log line above says "
                         f"why): convert an earlier checkpoint")
    whole = {k: v for k, v in state.items() if k != "dcp"} | read_tensors(path)
    write_file(out, whole)
    return whole


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
