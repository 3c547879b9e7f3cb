"""Install a distribution's own Requires-Dist list, minus named packages (run inside the target venv).

vLLM's CPU wheel lists torchvision, torchaudio and torchcodec, which fail to import against its torch
build and then kill `vllm serve`; triton is GPU-only. Usage: python install_requires_except.py DIST NAME...
"""
import re
import subprocess
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

dist, excluded = sys.argv[1], {n.lower() for n in sys.argv[2:]}
wanted = []
for line in requires(dist) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if re.sub(r"[-_.]+", "-", req.name.lower()) in excluded:
        continue
    wanted.append(str(req).split(";")[0].strip())
print("installing:", " ".join(wanted), flush=True)
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", "-q", *wanted]))
