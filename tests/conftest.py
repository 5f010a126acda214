import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Under pytest-xdist (the README's test command: -n auto) the cores are shared out between the workers: torch's own
# threads, one pool per worker, would otherwise ask for every core each and fight over them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def loaded():
    """The embedded model, loaded once for the whole session."""
    from pkvbench.engine.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def engine(loaded):
    from pkvbench.engine.generation import Engine

    return Engine(loaded)


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer alone: read from the model's float copy (made once if missing), in about 1 s."""
    from pkvbench.engine.models import load_tokenizer

    return load_tokenizer()
