"""The matrix service runs without torch: importing its server loads neither torch nor transformers
(its trees come from engine/tr/template.py, its drafting is the numpy gather of engine/tr/gather.py).
Checked in a fresh interpreter; on failure the message names the import chain that pulled them in."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

HEAVY = ("torch", "transformers")

# Records, at the first import of each heavy package, which repository files were importing it.
PROBE = r"""
import json, os, sys, traceback

HEAVY, REPO = {heavy!r}, {repo!r}
chains = {{}}


class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY and top not in chains:
            chains[top] = [f"{{os.path.relpath(f.filename, REPO)}}:{{f.lineno}}"
                           for f in traceback.extract_stack()[:-1] if f.filename.startswith(REPO + os.sep)]
        return None


sys.meta_path.insert(0, Watch())
import {module}
print(json.dumps({{name: chains.get(name, ["(no repository frame)"]) for name in HEAVY if name in sys.modules}}))
"""


def test_importing_the_matrix_server_loads_no_torch() -> None:
    code = PROBE.format(heavy=HEAVY, repo=str(REPO), module="trserve.services.matrix.server")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    chains = "\n".join(f"{name}: " + " -> ".join(chain) for name, chain in loaded.items())
    assert not loaded, f"import trserve.services.matrix.server loads {sorted(loaded)}; imported via:\n{chains}"
