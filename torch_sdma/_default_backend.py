"""Work around torch 2.9-2.13 never setting a default backend type for "cpu:gloo,cuda:<custom>".

Those versions pick `next(iter(Backend._plugins))` (an upper-case key) and compare it with the lower-case
backend names of the group, so the default stays unset: getDefaultBackend() then fails and
destroy_process_group() warns (https://github.com/pytorch/pytorch/issues/178756, fixed in 2.14). Putting a
lower-case alias of our plugin first makes that comparison succeed for "sdma"; lookups by the upper-case name are
unchanged.
"""
import torch.distributed as dist

from ._torch_version import torch_version

_FIXED_IN = (2, 14)


def apply(name: str) -> None:
    if torch_version() >= _FIXED_IN:
        return
    plugins = dist.Backend._plugins
    if name.lower() in plugins or name.upper() not in plugins:
        return
    entries = list(plugins.items())
    plugins.clear()
    plugins[name.lower()] = dict(entries)[name.upper()]
    plugins.update(entries)
