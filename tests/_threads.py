"""One torch thread for tests that train or time tiny models: on a loaded 2-core machine a tiny
forward/backward runs ~10x faster on one thread than on an oversubscribed pool. Import the
fixture into a test module to make it autouse there."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
