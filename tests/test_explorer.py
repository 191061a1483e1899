"""nbmem.explore: the panel's controls re-estimate; the button checks for real."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbmem
from nbmem.frontend import explorer as explorer_module
from nbmem.frontend.explorer import Explorer


def build():
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make(n):
    return torch.randn(n, 784), torch.randint(0, 10, (n,))


def test_moving_a_control_re_estimates_and_redraws():
    panel = Explorer(build, make, batch_size=64, device="T4")
    assert panel.last.batch_size == 64 and "fits" in panel.chart.value and "nbmem-explore-bar" in panel.chart.value
    panel.controls["batch_size"].value = 256
    assert panel.last.batch_size == 256
    panel.controls["optimizer"].value = "sgd"
    assert panel.last.optimizer == "sgd" and dict(panel.last.breakdown.after)["optimizer state"] == 0
    panel.controls["device"].value = "A100-80GB"
    assert panel.last.capacity_label == "A100-80GB"
    assert panel.last.peak == nbmem.estimate(build, make, batch_size=256, optimizer="sgd").peak


def test_the_button_measures_the_configuration_for_real():
    panel = Explorer(build, make, batch_size=32, device="T4")
    panel.button.click()
    assert panel.measured.mode == "tracked" and panel.measured.batch_size == 32
    assert "run for real, tracked on this CPU: " in panel.check.value
    assert panel.measured.peak == pytest.approx(panel.last.peak, rel=0.01)


def test_a_tiny_device_says_it_does_not_fit():
    panel = Explorer(build, make, batch_size=64, device="1MiB")
    assert "does NOT fit" in panel.chart.value


def test_without_widgets_it_says_so_and_suggests_sweep(capsys, monkeypatch):
    monkeypatch.setattr(explorer_module._env, "widgets_usable", lambda shell=None: False)
    assert nbmem.explore(build, make) is None
    assert "nbmem.sweep" in capsys.readouterr().out


def test_bad_device_is_refused_at_once():
    with pytest.raises(ValueError, match="16GiB"):
        Explorer(build, make, device="T5000")
