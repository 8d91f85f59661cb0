"""TensorBoard events for rank 0; other ranks get a do-nothing board.

Tags follow the tutorials, so runs compare against their example logs: ``Loss/train``,
``Loss/valid``, ``Learning Rate``, ``Avg iters per sec``, ``Avg samples per sec``, and for the ViT
``RMSE(u10m)/valid``; ``Grad norm`` is the 2-norm of the whole gradient before clipping.
"""
from __future__ import annotations

import numpy as np
from torch.utils.tensorboard import SummaryWriter


class NullBoard:
    def scalar(self, tag, value, step):
        pass

    def image(self, tag, img, step):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class Board(NullBoard):
    def __init__(self, logdir: str, purge_step: int | None = None):
        # purge_step drops events a crashed run wrote after its last checkpoint.
        self.writer = SummaryWriter(log_dir=logdir, purge_step=purge_step)

    def scalar(self, tag, value, step):
        self.writer.add_scalar(tag, value, step)

    def image(self, tag, img, step):
        self.writer.add_image(tag, img, step, dataformats="HWC")

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


# A perceptually ordered colour map (dark blue -> teal -> yellow), interpolated from 5 anchors.
_ANCHORS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                    dtype=np.float32)


def colormap(a: np.ndarray, lo: float, hi: float) -> np.ndarray:
    t = np.clip((a - lo) / (hi - lo + 1e-12), 0, 1) * (len(_ANCHORS) - 1)
    i = np.minimum(t.astype(int), len(_ANCHORS) - 2)
    f = (t - i)[..., None]
    return ((1 - f) * _ANCHORS[i] + f * _ANCHORS[i + 1]).astype(np.uint8)


def comparison_image(target: np.ndarray, pred: np.ndarray, scale: int = 1) -> np.ndarray:
    """Target | prediction | error side by side (H, 3W + gaps, 3) uint8; the first two share a
    colour scale, the error panel is scaled to the target's range around zero."""
    lo, hi = float(target.min()), float(target.max())
    err = pred - target
    half = (hi - lo) / 2
    panels = [colormap(target, lo, hi), colormap(pred, lo, hi), colormap(err, -half, half)]
    gap = np.full((target.shape[0], 2, 3), 255, np.uint8)
    img = np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1)
    if scale > 1:
        img = img.repeat(scale, axis=0).repeat(scale, axis=1)
    return img
