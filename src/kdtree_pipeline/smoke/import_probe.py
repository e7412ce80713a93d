"""Run by :mod:`.imports` in the server's Python: import each module named on the command line;
on a module missing from the path, note it and put a stand-in in its place, then go on; stop at the
first other failure. Prints one
line, ``KDTREE_IMPORTS {"missing": [[module, imported under]], "failed": [[module, error]]}``.
Standard library only: it runs before anything of this project is known to import."""

import importlib
import importlib.machinery
import json
import sys
import types


class Anything:
    """What a stand-in module gives for any name: a class that takes any arguments and any use."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return Anything()

    def __iter__(self):
        return iter(())

    def __getattr__(self, attr):
        return Anything.get(attr)

    @staticmethod
    def get(attr):
        if attr.startswith("__"):  # what tools read off a module (__file__, __version__) stays absent
            raise AttributeError(attr)
        return Anything


def stand_in(name):
    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # find_spec() finds it
    stub.__path__ = []
    stub.__getattr__ = Anything.get
    sys.modules[name] = stub


def probe(modules):
    missing, failed, stubbed = [], [], set()
    for m in modules:
        for _ in range(50):
            try:
                importlib.import_module(m)
                break
            except ModuleNotFoundError as e:
                n = e.name or ""
                top = n.split(".")[0]
                # the module asked for, a parent of it, or a module of a package that is there:
                # a fault of that code, not a package the path lacks
                if not n or n in sys.modules or n == m or m.startswith(n + ".") or (
                        top in sys.modules and top not in stubbed):
                    failed.append([m, f"{type(e).__name__}: {e}"])
                    return {"missing": missing, "failed": failed}
                missing.append([n, m])
                stubbed.add(top)
                stand_in(n)
            except BaseException as e:  # noqa: BLE001 - any failure at import is the finding
                # the first failure ends the probe: it leaves packages (torch's too) half made, and
                # what later modules would report is that, not their own state
                failed.append([m, f"{type(e).__name__}: {str(e)[:300]}"])
                return {"missing": missing, "failed": failed}
    return {"missing": missing, "failed": failed}


if __name__ == "__main__":
    print("KDTREE_IMPORTS " + json.dumps(probe(sys.argv[1:])), flush=True)
