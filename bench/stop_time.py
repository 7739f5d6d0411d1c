"""How long a command takes to exit after a signal, once it printed what says it is up.

    python bench/stop_time.py "(serving at[\\s\\S]*){2}" SIGINT \\
        torchrun --standalone --nproc-per-node 2 launch/serve.py --tp 1 --engine cpu

Prints ``ready <s>  signal->exit <s>  rc=<code>  load <1-minute load average>``; ``OUTF=path`` keeps the output.
"""

import os
import re
import signal
import subprocess
import sys
import time


def main() -> int:
    pat, sig, cmd = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3:]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert p.stdout is not None
    buf = b""
    t0 = time.monotonic()
    while not re.search(pat.encode(), buf) and time.monotonic() - t0 < 300:
        data = os.read(p.stdout.fileno(), 65536)
        if not data:
            break
        buf += data
    ready = time.monotonic() - t0
    load = os.getloadavg()[0]
    ts = time.monotonic()
    p.send_signal(sig)
    rest = p.stdout.read()
    p.wait()
    print(f"ready {ready:.1f}s  signal->exit {time.monotonic() - ts:.2f}s  rc={p.returncode}  load {load:.1f}")
    if os.environ.get("OUTF"):
        with open(os.environ["OUTF"], "w") as f:
            f.write((buf + rest).decode(errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
