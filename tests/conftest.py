import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
