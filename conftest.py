"""Shared by every test file: each test starts from the same global random state."""

import pytest
import torch


@pytest.fixture(autouse=True)
def same_random_state_for_every_test():
    # a test that draws its inputs from the global generator would otherwise get other numbers
    # whenever the tests before it change: another order, a -k selection, the tests skipped
    # without the optional packages or without a GPU
    torch.manual_seed(0)
