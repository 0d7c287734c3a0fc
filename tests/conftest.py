import pytest

from tests.helpers import ServerProcess


@pytest.fixture(scope="module")
def server():
    """One real omlx server (embedded SmolLM2) per test module."""
    with ServerProcess() as s:
        yield s
