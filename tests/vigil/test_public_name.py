"""``import vigil``: the public rank API and client by one name, which no module of Vigil's hides.

Needs: torch (the rank API imports it on first use); one fresh interpreter for the import-cost rule.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import vigil

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_is_the_api_even_after_every_submodule_is_imported() -> None:
    # Importing a submodule sets it as an attribute of the package: a module named like an API function
    # (vigil/checkpoint/ once) would replace ``vigil.checkpoint`` the function for every caller after it.
    for info in pkgutil.walk_packages(vigil.__path__, "vigil."):
        if ".bench" not in info.name:
            importlib.import_module(info.name)
    for name in vigil.__all__:
        value = getattr(vigil, name)
        assert not isinstance(value, types.ModuleType), f"vigil.{name} is a module, not the API"
    from vigil import sdk

    assert vigil.checkpoint is sdk.checkpoint and vigil.step is sdk.step and vigil.init is sdk.init
    from vigil.contract.client import VigilClient

    assert vigil.Client is VigilClient


def test_import_vigil_costs_no_torch_and_the_old_name_still_works() -> None:
    code = ("import sys, vigil; assert 'torch' not in sys.modules, 'import vigil pulled torch';"
            "from trainer import sdk; import vigil.sdk as s; assert sdk.init is s.init is vigil.init")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
