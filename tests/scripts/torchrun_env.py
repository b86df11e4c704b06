"""Print, as one JSON line, torchrun's variables as this instance got them, and what they point at.

No torch: the host name, the CPU affinity (OMP_NUM_THREADS is divided from it), and whether the
directory of TORCHELASTIC_ERROR_FILE exists and this instance can write its file there.
"""

import json
import os
import socket

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
         "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")

error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
writable = False
if error_file and os.path.isdir(os.path.dirname(error_file)) and not os.path.exists(error_file):
    with open(error_file, "w") as f:  # as torch's @record would; a run that exits 0 sends nothing back
        f.write("{}")
    writable = True
print(json.dumps({"host": socket.gethostname(), "cores": len(os.sched_getaffinity(0)), "error_file_writable": writable,
                  "env": {name: os.environ.get(name) for name in NAMES}}), flush=True)
