"""The suite's own set-up, as pyproject's addopts run it (`-n 2 --dist loadgroup`)."""

import pytest


@pytest.mark.ray
def test_the_ray_tests_share_one_worker(request):
    """Under loadgroup the scheduler reads a test's group from its id alone, where pytest-xdist
    writes it. pytest 9.2 keeps the id elsewhere (pyproject.toml pins below it), and the Ray tests
    then ran on both workers, each starting a Ray of its own, with nothing failing to say so."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under xdist's loadgroup (e.g. -n 0): every test runs in this process")
    assert request.node.nodeid.endswith("@ray"), (
        f"{request.node.nodeid}: pytest-xdist did not tag the Ray group into the test id, so the Ray tests "
        "are spread over the workers; this pytest and pytest-xdist do not work together")
