"""When the plugin activates: explicit opt-in, --device tpu, an attached TPU; never silently.

Pure Python (no vLLM, no JAX), so it runs in the main test venv as well.
"""

from __future__ import annotations

import pytest

from tpuserve.tpu_platform.vllm_plugin import PLATFORM_QUALNAME, register
from tpuserve.tpu_platform.vllm_plugin.activation import ENV_VAR, decide, device_flag_value

pytestmark = pytest.mark.timeout(60)


def test_no_tpu_no_opt_in_is_inactive():
    d = decide(environ={}, argv=["vllm", "serve", "m"], tpu=False)
    assert not d.active and "no TPU" in d.reason


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes"])
def test_env_opt_in(value):
    assert decide(environ={ENV_VAR: value}, argv=[], tpu=False).active


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_env_opt_out_beats_tpu_and_flag(value):
    d = decide(environ={ENV_VAR: value}, argv=["vllm", "serve", "m", "--device", "tpu"], tpu=True)
    assert not d.active


def test_bad_env_value_is_an_error():
    with pytest.raises(ValueError, match=ENV_VAR):
        decide(environ={ENV_VAR: "maybe"}, argv=[], tpu=False)


@pytest.mark.parametrize(
    "argv", [["vllm", "serve", "m", "--device", "tpu"], ["vllm", "serve", "--device=TPU", "m"]]
)
def test_device_flag_opts_in(argv):
    d = decide(environ={}, argv=argv, tpu=False)
    assert d.active and "--device" in d.reason


def test_other_device_values_do_not_opt_in():
    assert not decide(environ={}, argv=["x", "--device", "cuda"], tpu=False).active
    assert device_flag_value(["x", "--device-ids", "0", "--device", "cpu"]) == "cpu"
    assert device_flag_value(["x", "--device-ids", "0"]) is None


def test_attached_tpu_activates_without_opt_in():
    assert decide(environ={ENV_VAR: "auto"}, argv=[], tpu=True).active


def test_register_pins_the_choice_for_child_processes(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--device", "tpu"])
    assert register() == PLATFORM_QUALNAME
    import os

    assert os.environ[ENV_VAR] == "1"


def test_register_returns_none_when_inactive(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--device", "tpu"])
    assert register() is None
