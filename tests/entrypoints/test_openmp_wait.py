"""How `servelab serve` sets the OpenMP wait of its engine cores (serve.set_openmp_wait): a short spin for a core
in its own process, PASSIVE for an engine stepped in the API server's process, the user's setting untouched."""
import pytest

from servelab.entrypoints.serve import OPENMP_SPIN_COUNT, set_openmp_wait


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    return monkeypatch


def test_engine_core_process_spins_briefly(env):
    import os

    set_openmp_wait(engine_in_process=False)
    assert os.environ["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT == "10000" and "OMP_WAIT_POLICY" not in os.environ


def test_engine_in_process_is_passive(env):
    import os

    set_openmp_wait(engine_in_process=True)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0")])
def test_the_users_setting_wins(env, name, value):
    import os

    env.setenv(name, value)
    for in_process in (False, True):
        set_openmp_wait(engine_in_process=in_process)
        assert os.environ[name] == value
        assert {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys() == {name}
