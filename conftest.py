"""Shared by every test file: each test starts from the same global random state; the compile
tests run on torch 2.13 and newer."""

import pytest
import torch


@pytest.fixture(autouse=True)
def same_random_state_for_every_test():
    # a test that draws its inputs from the global generator would otherwise get other numbers
    # whenever the tests before it change: another order, a -k selection, the tests skipped
    # without the optional packages or without a GPU
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # The compile tests check that torch.compile runs this code's graphs, as torch 2.13 and 2.15 do.
    # Older compilers reject some of them (2.8's Dynamo cannot trace torch.amp.is_autocast_available;
    # 2.8's and 2.12's Inductor fail on the loop over chunks), where the models fall back to eager
    # with one warning: that would test the older compiler, not this code.
    if torch.__version__ < "2.13":
        skip = pytest.mark.skip(reason=f"the compile tests need torch >= 2.13, this is {torch.__version__}")
        for item in items:
            if item.get_closest_marker("compile"):
                item.add_marker(skip)
