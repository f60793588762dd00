"""`fn.init`'s forward pass (`_transform/discovery.py`): on the meta device when it can, else for
real."""

import torch
from _helpers import (
    DELAYED,
)
from torch import nn

import fp8fn


def test_init_does_not_compute_real_activations():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            seen.append(x.device.type)
            return self.fc(x)

    fp8fn.transform(Probe(), DELAYED).init(torch.randn(4, 16))
    assert seen == ["meta"]


def test_init_falls_back_to_real_run_for_data_dependent_models():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    x = torch.ones(4, 16)
    assert list(fp8fn.transform(DataDependent(), DELAYED).init(x)) == ["a", "b"]
