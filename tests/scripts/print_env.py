"""Print this instance's launcher-given environment as one JSON line."""

import json
import os

KEYS = [k for k in os.environ if k.startswith(("POPDIST_", "POPRUN_"))] + [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTHONUNBUFFERED", "FOO", "BAR"]
print(json.dumps({k: os.environ.get(k) for k in KEYS}))
