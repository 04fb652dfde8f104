"""The seed workloads (seed 001: pointwise-heavy and matmul-heavy; seed 000: TinyBlock), shared
by the benchmark and the tests."""
from __future__ import annotations

import torch
from torch import nn


class PointwiseHeavy(nn.Module):
    """Many elementwise ops, no matmul: memory-bound; fusion should make it one kernel."""

    def __init__(self, dim=4096):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        x = x * self.scale + self.bias
        x = torch.sin(x) + torch.cos(x) * torch.tanh(x)
        x = x * torch.sigmoid(x) + torch.relu(x)
        x = x / (1.0 + torch.abs(x))
        x = torch.sin(x) + torch.cos(x) * torch.tanh(x)
        x = x * torch.sigmoid(x) + torch.relu(x)
        x = x / (1.0 + torch.abs(x))
        x = torch.sin(x) + torch.cos(x) * torch.tanh(x)
        x = x * torch.sigmoid(x) + torch.relu(x)
        return x


class MatmulHeavy(nn.Module):
    """Large linears with one relu each: compute-bound."""

    def __init__(self, dim=4096, num_layers=4):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])

    def forward(self, x):
        for linear in self.linears:
            x = torch.relu(linear(x))
        return x


class TinyBlock(nn.Module):
    """LayerNorm, MLP with gelu, a scale and shift, and a residual (seed 000)."""

    def __init__(self, hidden=768, expansion=4):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, hidden * expansion)
        self.fc2 = nn.Linear(hidden * expansion, hidden)

    def forward(self, x):
        residual = x
        x = self.ln(x)
        x = self.fc1(x)
        x = torch.nn.functional.gelu(x)
        x = x * 1.41421356 + 0.01
        x = self.fc2(x)
        return x + residual
