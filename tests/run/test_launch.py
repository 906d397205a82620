"""A rank's start (run/launch.py start_rank) on a full disk: its comm record and log cannot be written, and that is
one storage-error line (exit 4 through fail_rank), not a traceback on the launcher's console. An elastic job's warm
rank hit it at the next generation when its node's disk was full (the chaos run)."""

import os
import subprocess
import sys

CODE = """
import resource
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))  # writes past 1 KiB fail: EFBIG
from nanotitan.run.launch import start_rank
try:
    start_rank(sys.argv[1], 60)
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
"""


def test_a_full_disk_at_a_ranks_start_is_a_storage_error(tmp_path):
    logs = tmp_path / "logs"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", NANOTITAN_LOG_DIR=str(logs), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", "import sys" + CODE, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.stdout.strip() == f"StorageError: cannot write the rank's logs in {logs}: File too large (EFBIG)", \
        (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
