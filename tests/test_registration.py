"""Registration: the entry points make `resident` available without `import resident_pg`,
without loading the extension during `import torch`, and a failure there never breaks torch."""

import subprocess
import sys


def _py(code, **env):
    import os

    full_env = dict(os.environ)
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=full_env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_torch_registers_without_loading_the_extension():
    out = _py("import sys, torch, torch.distributed as dist;"
              "print('RESIDENT' in dist.Backend._plugins, 'resident_pg._C' in sys.modules)")
    assert out.splitlines()[-1] == "True False"


def test_backend_devices_are_cpu_and_cuda():
    out = _py("import torch.distributed as dist, resident_pg;"
              "print(sorted(dist.Backend.backend_capability['resident']))")
    assert out.splitlines()[-1] == "['cpu', 'cuda']"


def test_registration_failure_is_swallowed():
    # A broken torch.distributed must not make the entry point (called by `import torch`) raise.
    out = _py(
        "import torch.distributed as dist\n"
        "def boom(*a, **k): raise RuntimeError('simulated')\n"
        "dist.Backend._plugins.pop('RESIDENT', None)\n"
        "dist.Backend.register_backend = boom\n"
        "from resident_pg._autoload import register\n"
        "register(); print('survived', 'RESIDENT' in dist.Backend._plugins)",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert out.splitlines()[-1] == "survived False"


def test_pg_options_are_validated():
    import pytest

    from resident_pg._backend import normalize_options

    assert normalize_options({"RESIDENT_PATH": "proxy", "slots": 8}) == {"path": "proxy", "slots": "8"}
    with pytest.raises(ValueError, match="unknown option"):
        normalize_options({"no_such_knob": 1})
    with pytest.raises(TypeError, match="dict"):
        normalize_options(42)


def test_python_option_keys_match_the_core():
    """The keys the Python side accepts as backend options are the core registry's pg_options
    keys (resident_pg._C.options(), csrc/core/options.def), the removed ones passed on to be
    refused there."""
    from resident_pg import _C
    from resident_pg._backend import _OPTION_KEYS, _REMOVED_KEYS

    core = _C.options()
    assert set(_OPTION_KEYS) == {o["key"] for o in core if o["pg_option"] and o["tier"] != "removed"}
    assert set(_REMOVED_KEYS) == {o["key"] for o in core if o["tier"] == "removed"}
    assert {"path", "slots", "debug"} <= set(_OPTION_KEYS) and "vllm" not in _OPTION_KEYS
