import os

import pytest

from tests.helpers import TEST_HOME, ServerProcess

# omlx lists every mlx-lm model in the Hugging Face hub cache: tests (and the servers they start,
# which inherit this environment) see a cache of the test home's, never the developer's own. Set
# before anything imports huggingface_hub, which reads it once.
os.environ["HF_HUB_CACHE"] = str(TEST_HOME / "hf-hub-cache")


@pytest.fixture(scope="module")
def server():
    """One real omlx server (embedded SmolLM2) per test module."""
    with ServerProcess() as s:
        yield s
