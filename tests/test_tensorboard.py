"""What a run puts in TensorBoard besides its curves: titled pictures with colour bars, named
metrics, the resolved config as text and as hyperparameters, and one chart with the losses."""
import glob
import io

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, write_cosmo_pair
from train import Trainer
from settings.parse import build_config
from engine.runtime import setup_runtime
from observe.tensorboard import colormap, comparison_image, text_mask


def test_text_mask_draws_each_character_and_blanks_unknown_ones():
    e, three = text_mask("E"), text_mask("3")
    assert e.shape == (5, 4) and e[:, 0].all() and not e[:, 3].any()
    assert not np.array_equal(e, three)
    assert text_mask("e").tolist() == e.tolist()  # drawn upper-case
    assert not text_mask("\u00b5").any() and text_mask("AB", size=2).shape == (10, 16)


def test_comparison_image_has_titles_and_colour_bars_with_their_ranges():
    target = np.linspace(-2, 6, 16 * 32, dtype=np.float32).reshape(16, 32)
    pred = target + 0.5
    img = comparison_image(target, pred, scale=8, title="u10", units="(m/s)")
    width = 32 * 8
    size = 2  # font pixels per image pixel on a 256-pixel panel
    strip = 7 * size
    assert img.dtype == np.uint8 and img.shape[1] == 3 * width + 2 * (2 * size + 2)
    assert img.shape[0] == strip + strip + 16 * 8 + 4 * size + strip
    # the title: "U10 (M/S)" in black at the top left
    title = text_mask("u10 (m/s)", size)
    drawn = (img[size:6 * size, :title.shape[1]] == 0).all(axis=2)
    assert np.array_equal(drawn, title)
    # each panel's name above it, its colour bar and range below it
    bar_row = strip + strip + 16 * 8
    diverging = np.array([[33, 102, 172], [247, 247, 247], [178, 24, 43]])  # -, 0, +
    for i, (name, lo, hi) in enumerate([("target", -2, 6), ("prediction", -2, 6),
                                        ("error", -4, 4)]):
        x0 = i * (width + 2 * size + 2)
        mask = text_mask(name, size)
        head = (img[strip + size:strip + 6 * size, x0:x0 + mask.shape[1]] == 0).all(axis=2)
        assert np.array_equal(head, mask), name
        bar = img[bar_row, x0:x0 + width]
        if name == "error":  # diverging, centred on 0: blue, white in the middle, red
            np.testing.assert_allclose(bar[[0, width // 2, -1]], diverging, atol=2)
        else:
            np.testing.assert_array_equal(bar[0], colormap(np.array(lo), lo, hi))
            np.testing.assert_array_equal(bar[-1], colormap(np.array(hi), lo, hi))
        foot = img[bar_row + 4 * size + size:bar_row + 4 * size + 6 * size, x0:x0 + width]
        left = text_mask(f"{lo:.3g}", size)
        assert np.array_equal((foot[:, :left.shape[1]] == 0).all(axis=2), left)


def _events(run_dir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for path in glob.glob(f"{run_dir}/tensorboard/events.*"):
        yield from EventFileLoader(path).Load()


def test_unet_run_names_its_fields_and_describes_itself(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    root = write_cosmo_pair(tmp_path / "cosmo", side=32)
    over = dict(base_width="4", max_width="16", synthesize_if_missing="false", data_root=root,
                expdir=str(tmp_path / "logs"), num_iters="4", lr="3e-3")
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "quickstart", over)
    tr = Trainer(cfg, setup_runtime(cfg))
    tr.fit()
    tags, hp, text, layout, picture = set(), {}, "", None, None
    for event in _events(tr.run_dir):
        for v in event.summary.value:
            tags.add(v.tag)
            plugin = v.metadata.plugin_data.plugin_name
            if plugin == "hparams":
                data = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    hp = {k: val for k, val in data.session_start_info.hparams.items()}
            elif plugin == "text":
                text = v.tensor.string_val[0].decode()
            elif plugin == "custom_scalars":
                layout = layout_pb2.Layout.FromString(v.tensor.string_val[0])
            elif plugin == "images":  # [width, height, PNG]
                picture = np.asarray(Image.open(io.BytesIO(v.tensor.string_val[2])))
    for name in ("log_rho", "log_T", "vx", "vy", "vz"):
        assert f"L1({name})/valid" in tags, tags
    assert hp["lr"].number_value == pytest.approx(3e-3) and hp["model"].string_value == "unet"
    assert hp["global_batch_size"].number_value == cfg.global_batch_size
    assert "steps_per_epoch" in hp and "lambda_rho: " in text and "base_width: 4" in text
    chart = layout.category[0].chart[0]
    assert chart.title == "unet: train, valid and predict-the-mean baseline"
    assert list(chart.multiline.tag) == ["^Loss/train$", "^Loss/valid$",
                                         "^Loss/valid_predict\\-the\\-mean$"]
    flags = {k: v for k, v in hp.items() if k in ("enable_fused", "full_scale", "noddp")}
    assert set(flags) == {"enable_fused", "full_scale", "noddp"}
    assert all(v.WhichOneof("kind") == "bool_value" for v in flags.values()), flags
    assert flags["full_scale"].bool_value is False
    assert picture is not None and picture.shape[0] > 32 and (picture == 0).all(axis=2).any()
    log = open(f"{tr.run_dir}/out.log").read()
    assert "Val L1 per channel, model / predict-the-mean:\n" in log and "    log_rho " in log
