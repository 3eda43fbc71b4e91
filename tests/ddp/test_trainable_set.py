"""What FastDDPStrategy watches to wrap a model again: which parameters train, and a line saying what changed."""

from __future__ import annotations

from torch import nn

from lightning_fastdist.parallel.gradients.trainable import TrainableSet


def test_a_freeze_or_an_unfreeze_is_reported_once_and_nothing_when_nothing_changed():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    watched = TrainableSet(model)
    assert watched.changed(model) is None
    model[0].requires_grad_(True)
    assert watched.changed(model) == "2 parameters became trainable"
    assert watched.changed(model) is None
    model[0].weight.requires_grad_(False)
    model[1].requires_grad_(False)
    assert watched.changed(model) == "3 parameters froze"
    model[0].weight.requires_grad_(True)
    model[1].bias.requires_grad_(True)
    assert watched.changed(model) == "2 parameters became trainable"
