"""The events of a torch.profiler run, as its exported Chrome trace lists them (what Perfetto and HTA read)."""
import json
import os
import tempfile


def exported_events(prof):
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
