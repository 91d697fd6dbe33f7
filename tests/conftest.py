import pytest


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    from tests.tiny_models import make_family

    return make_family(tmp_path_factory.mktemp("tiny_family"))
