"""Partition clipping (`altgrad.train.partition_clip`): each layer's update bounded."""

from __future__ import annotations

import pytest

from altgrad.train import Trainer

pytestmark = pytest.mark.usefixtures("eager_kernels")


def test_partition_clipping_bounds_each_layer(make_config, tmp_path):
    k = 0.5
    trainer = Trainer(make_config("quant.format=e4m3", "optim.partition_clip_k=0.5",
                                  "train.max_steps=5", "train.shadow_every=0"), tmp_path)
    clipper = trainer.clipper
    clip = clipper.clip_
    checked = []

    def checking_clip():
        limits = [k * h.amax_history.max() for h in clipper.histories]
        raw = [w.grad.abs().amax() for w in clipper.weights]
        clip()
        for w, h, limit, before in zip(clipper.weights, clipper.histories, limits, raw, strict=True):
            if limit > 0:
                assert w.grad.abs().amax() <= limit
                checked.append(bool(before > limit))
            assert h.amax_history[-1] == w.grad.abs().amax()  # recorded after clipping

    clipper.clip_ = checking_clip
    trainer.fit()
    assert checked and any(checked)  # something was actually clipped
