"""``async-processor demo``: the whole pipeline on this machine, with a live summary."""
