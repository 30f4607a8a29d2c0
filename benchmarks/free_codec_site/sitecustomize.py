"""On the broker process's PYTHONPATH under ``broker_throughput.py --free-codec``: see ../free_codec.py."""

import os
import sys

if os.environ.get("TIDAL_BENCH_FREE_CODEC"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from free_codec import install_from_env

    sys.path.pop(0)
    install_from_env()
