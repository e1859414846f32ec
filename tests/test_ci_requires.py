"""In CI a missing test dependency fails the tests that need it (issue 26): transformers, torch and PyAV
are what the Hugging Face and LeRobot tests compare against, and a skip there would pass a broken install."""

import pytest

from conftest import require


def test_a_missing_dependency_skips_on_a_laptop_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require("jaxpar_no_such_module")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ModuleNotFoundError):
        require("jaxpar_no_such_module")
    assert require("numpy").__name__ == "numpy"
