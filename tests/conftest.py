import os

import pytest
import torch

# Triton's CPU interpreter must be chosen before anything imports triton (its own helpers are decorated then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`slow` marks every test that runs the real SmolLM2 (or a notebook, which does); `cuda`-marked tests skip
    cleanly where there is no CUDA GPU (CI, the CPU machines)."""
    for item in items:
        if "smollm2" in item.nodeid or "smollm2_path" in getattr(item, "fixturenames", ()) or \
                item.nodeid.startswith("tests/test_notebooks.py::test_notebook_executes"):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_path():
    from common.models import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session")
def smollm2_path():
    from common.models import resolve_model

    return resolve_model("smollm2-135m-instruct")
