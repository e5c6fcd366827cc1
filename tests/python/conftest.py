"""Shared setup for the Python suite: one torch thread (the machines are
small and shared; the references are tiny), and the attnkit import path
check so a stale or missing build fails with a clear message."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # torch_ref.py

torch.set_num_threads(1)
os.environ.setdefault("ATTNKIT_NUM_THREADS", "2")


def pytest_report_header(config):
    import attnkit
    where = os.path.dirname(attnkit.__file__)
    return f"attnkit {attnkit.__version__} from {where}; torch {torch.__version__}"


@pytest.fixture(params=["auto", "reference"])
def backend(request):
    """Every numerical test runs on the fast kernels and on the reference twin."""
    return request.param
