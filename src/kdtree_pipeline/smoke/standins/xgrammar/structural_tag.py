from xgrammar import _Stub

_cache = {}


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _cache:
        _cache[name] = type(name, (_Stub,), {"__module__": __name__})
    return _cache[name]
