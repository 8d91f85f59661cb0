"""TensorBoard events for rank 0 (other ranks get a ``Nothing``); and the pictures drawn
for it. What a run writes there: docs/example-runs.md (its tags are the tutorials', so that runs
compare against their example logs)."""
from __future__ import annotations

import re

import numpy as np
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


class Board:
    def __init__(self, logdir: str, purge_step: int | None = None):
        # purge_step drops events a crashed run wrote after its last checkpoint.
        self.writer = SummaryWriter(log_dir=logdir, purge_step=purge_step)

    def scalar(self, tag, value, step):
        self.writer.add_scalar(tag, value, step)

    def image(self, tag, img, step):
        self.writer.add_image(tag, img, step, dataformats="HWC")

    def describe_run(self, settings: dict, baseline_tag: str):
        """The run's settings (TEXT and HPARAMS tabs), and the training, validation and baseline
        losses on one chart (CUSTOM SCALARS tab)."""
        lines = [f"{k}: {v}" for k, v in settings.items()]
        self.writer.add_text("Config", "    " + "\n    ".join(lines), 0)  # a code block
        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                 for k, v in settings.items()}
        for summary in _hparams(plain, {"Loss/valid": 0.0, "Loss/train": 0.0}):
            self.writer.file_writer.add_summary(summary)  # in this run, beside its scalars
        # One chart per model (runs of both in one log directory give two), tags as regexes.
        model = settings.get("model", "")
        tags = ["Loss/train", "Loss/valid", baseline_tag]
        self.writer.add_custom_scalars({"Loss": {
            f"{model}: train, valid and {baseline_tag.split('_', 1)[-1]} baseline":
                ["Multiline", [f"^{re.escape(t)}$" for t in tags]]}})

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


def _hparams(values: dict, metrics: dict):
    """torch's ``hparams`` summaries with booleans as booleans (torch files them as numbers,
    because it tests for int first: the HPARAMS tab then shows 1.0 for true)."""
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    summaries = hparams(values, metrics)
    flags = {k for k, v in values.items() if isinstance(v, bool)}
    for summary in summaries:
        for value in summary.value:
            data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
            if data.HasField("session_start_info"):
                for k in flags:
                    data.session_start_info.hparams[k].bool_value = values[k]
            elif data.HasField("experiment"):
                for info in data.experiment.hparam_infos:
                    if info.name in flags:
                        info.type = api_pb2.DATA_TYPE_BOOL
            value.metadata.plugin_data.content = data.SerializeToString()
    return summaries


# A perceptually ordered colour map (dark blue -> teal -> yellow), interpolated from 5 anchors.
_ANCHORS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                    dtype=np.float32)

# A diverging map for signed errors: blue (negative) -> white (zero) -> red (positive).
_DIVERGING = np.array([[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130],
                       [178, 24, 43]], dtype=np.float32)


def colormap(a: np.ndarray, lo: float, hi: float, anchors: np.ndarray = _ANCHORS) -> np.ndarray:
    t = np.clip((a - lo) / (hi - lo + 1e-12), 0, 1) * (len(anchors) - 1)
    i = np.minimum(t.astype(int), len(anchors) - 2)
    f = (t - i)[..., None]
    return ((1 - f) * anchors[i] + f * anchors[i + 1]).astype(np.uint8)


# A 3 x 5 pixel font for the captions drawn into pictures (TensorBoard shows images without
# titles or colour bars; a plotting library would be one more dependency of every run).
_GLYPHS = {
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011", "D": "110101101101110",
    "E": "111100110100111", "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010", "P": "110101110100100",
    "Q": "010101101110011", "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111", "0": "111101101101111", "1": "010110010010111",
    "2": "110001010100111", "3": "110001010001110", "4": "101101111001001", "5": "111100110001110",
    "6": "011100111101111", "7": "111001010010010", "8": "111101111101111", "9": "111101111001110",
    ".": "000000000000010", "-": "000000111000000", "+": "000010111010000", "_": "000000000000111",
    "(": "010100100100010", ")": "010001001001010", ":": "000010000010000", "/": "001001010100100",
    "=": "000111000111000", ",": "000000000010100", " ": "000000000000000",
}


def text_mask(text: str, size: int = 1) -> np.ndarray:
    """``text`` (upper-cased; unknown characters blank) as a boolean mask, 5 * size pixels high,
    4 * size per character."""
    cols = []
    for ch in text.upper():
        g = np.array([c == "1" for c in _GLYPHS.get(ch, _GLYPHS[" "])]).reshape(5, 3)
        cols += [g, np.zeros((5, 1), bool)]
    mask = np.concatenate(cols, axis=1) if cols else np.zeros((5, 0), bool)
    return mask.repeat(size, axis=0).repeat(size, axis=1)


def _caption(width: int, size: int, left: str, right: str = "") -> np.ndarray:
    """A white strip ``width`` wide with ``left`` at its left end and ``right`` at its right."""
    strip = np.full((7 * size, width, 3), 255, np.uint8)
    for text, at_right in ((left, False), (right, True)):
        mask = text_mask(text, size)[:, :width]
        col = width - mask.shape[1] if at_right else 0
        strip[size:6 * size, col:col + mask.shape[1]][mask] = 0
    return strip


def comparison_image(target: np.ndarray, pred: np.ndarray, scale: int = 1,
                     title: str = "", units: str = "") -> np.ndarray:
    """Target | prediction | error (prediction - target), (H', W', 3) uint8, each titled over its
    colour bar (the error's centred on zero, half the target's range), under ``title``."""
    lo, hi = float(target.min()), float(target.max())
    half = (hi - lo) / 2
    fields = [(target, "target", lo, hi, _ANCHORS), (pred, "prediction", lo, hi, _ANCHORS),
              (pred - target, "error", -half, half, _DIVERGING)]
    width = target.shape[1] * scale
    size = 2 if width >= 240 else 1  # font pixels per image pixel
    columns = []
    for field, name, a, b, anchors in fields:
        panel = colormap(field, a, b, anchors).repeat(scale, axis=0).repeat(scale, axis=1)
        bar = colormap(np.linspace(a, b, width), a, b, anchors)[None].repeat(4 * size, axis=0)
        columns.append(np.concatenate([_caption(width, size, name), panel, bar,
                                       _caption(width, size, f"{a:.3g}", f"{b:.3g}")]))
    gap = np.full((columns[0].shape[0], 2 * size + 2, 3), 255, np.uint8)
    body = np.concatenate([columns[0], gap, columns[1], gap, columns[2]], axis=1)
    head = _caption(body.shape[1], size, f"{title} {units}".strip())
    return np.concatenate([head, body])
