"""A dataset module that records which process imports it (tests/test_preload.py)."""

import os

import torch
from torch.utils.data import Dataset

with open(os.environ["PRELOAD_PROBE_LOG"], "a") as log:
    log.write(f"{os.getpid()}\n")


class Pids(Dataset):
    """Item i is (the loading process's pid, 0, i)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return torch.tensor([float(os.getpid())]), 0, i
