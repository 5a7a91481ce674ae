"""The residual MLP block the fully_shard tests shard, and its sizes: no world size of the tests
divides them, so the pieces are uneven (and a 2-row head leaves empty ones at 4 ranks)."""

import torch
from torch import nn

DIM, HIDDEN = 12, 20


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
