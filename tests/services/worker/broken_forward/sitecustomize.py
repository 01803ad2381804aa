"""Test helper, on PYTHONPATH of a `trserve serve` subprocess only (tests/services/worker/
test_startup_failures.py): every native forward raises, as a kernel library refusing its input did,
so the worker's warm-up generation fails."""

import importlib
import importlib.abc
import sys


class _PatchRunner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "trserve.engine.model.runner":
            sys.meta_path.remove(self)
            importlib.import_module(name)
            from trserve.engine.model import native

            def refused(self, *args, **kwargs):
                raise RuntimeError("native forward refused its input (code -1)")

            native.NativeForward.__call__ = refused
        return None


sys.meta_path.insert(0, _PatchRunner())
