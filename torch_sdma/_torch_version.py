"""The (major, minor) of the torch this process runs: the version checks of the workarounds compare against it."""
import torch


def torch_version(version: str = torch.__version__) -> tuple:
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    return major, minor
