"""Print the platform a requirements lock is resolved for: the Python implementation and minor version, the OS
and the machine (e.g. "CPython 3.11 linux x86_64"). pip picks wheels, and the dependencies their markers
select, by these, so tools/lock_requirements.sh records the line in requirements.lock and update_req.sh
compares it with the env it installs into.

Run: venv/bin/python tools/python_platform.py
"""

import platform
import sys

print(platform.python_implementation(), f"{sys.version_info.major}.{sys.version_info.minor}", sys.platform, platform.machine())
