"""Run the documented commands (README.md, docs/quickstart.md) as a new user would, and check the transcript.

    python bench/first_hour_transcript.py --home /tmp/fresh-home --out /tmp/transcript.txt

Each command runs in a fresh ``$ROLLOUT_SDK_HOME`` shared by the commands in order (the first demo trains
the tool model there). Every chunk of output (stdout and stderr together, progress-bar updates included)
is timestamped; the table flags a warning, a deprecation, a traceback or an error line, and the longest
silence (a wait with no output at all). Server commands run until their READY line, get their checks,
then SIGINT. Prints one row per command; the full transcript goes to ``--out``.

``--readme-install`` (in a fresh clone, no ``.venv`` yet) first runs the README's first command line
exactly as written (``python3 -m venv .venv && ... && pip install -e . && rollout-sdk demo``) with bash, and
runs every later command with that venv's python. Lines pip prints about this machine's own configuration
(``WARNING: Location 'file:///opt/...' is ignored``: find-links to folders this machine lacks) are counted
apart, not flagged: a user's pip does not print them.  ``--venv-has-torch``: the clone's ``.venv`` already
holds ``pip install torch==2.13.0`` (the local CPU build, installed ahead to save minutes); the README's line
runs as written over it (pip finds torch satisfied).  ``--readme-tests`` also runs the README's second line
(venv, test install, ``pytest``) as written.

Beyond the README and the quickstart, the commands the other docs tell the reader to run on one machine:
``rollout-sdk secret`` (launch.md, security.md), ``serve --address-file`` and ``serve --model "$(rollout-sdk
make-model tool)"`` (launch.md), and the gateway with the quickstart's / gateway.md's ``openai`` snippet run
against it (after the ``pip install openai`` both docs name; the snippet gets its own row).  The port 8000
the docs use is replaced by a free one.  Sketches with placeholders (``policy = ...``, ``tcp://10.0.0.5``,
multi-node and GPU commands) are not run.

``--burner`` runs one CPU burner (``python -c 'while True: pass'``) beside each command, started just
before it and killed just after, never beside the pip installs or the test suite.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parent.parent
FLAGS = re.compile(r"warning|deprecat|traceback|\berror\b|exception", re.I)  # not "errors 0" in a stats row
TOOL = '"$(rollout-sdk make-model tool)"'  # as the docs write it: bash runs it


def shell(line: str) -> list[str]:
    """``rollout-sdk <line>`` through bash (the docs' ``$(...)``), exec'd: a SIGINT reaches rollout-sdk."""
    return ["bash", "-c", f"exec rollout-sdk {line}"]


MACHINE_PIP = re.compile(r"^WARNING: Location 'file:///opt/\S+' is ignored: it is neither a file nor a directory\.$")


def python_blocks(doc: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)


def run(
    cmd: list[str],
    env: dict[str, str],
    *,
    until: str | None = None,
    then=None,
    limit_s: float = 1800,
    burner: bool = False,
) -> dict:
    """Run ``cmd``; with ``until``, wait for that text, call ``then(text_so_far)``, then send SIGINT.  With
    ``burner``, one busy-looping process runs beside it and is killed when it ends."""
    load = os.getloadavg()[0]
    burn = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if burner else None
    try:
        return _run(cmd, env, until=until, then=then, limit_s=limit_s) | {"load": round(load, 1)}
    finally:
        if burn is not None:
            burn.kill()
            burn.wait()


def _run(cmd: list[str], env: dict[str, str], *, until: str | None, then, limit_s: float) -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    chunks: list[tuple[float, str]] = []
    text = ""
    signalled = False
    last = t0
    gap = 0.0
    while True:
        if time.monotonic() - t0 > limit_s:
            proc.kill()
            chunks.append((time.monotonic() - t0, "\n[transcript: killed at the limit]\n"))
            break
        if not sel.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            break
        now = time.monotonic()
        gap = max(gap, now - last)
        last = now
        s = data.decode(errors="replace")
        chunks.append((now - t0, s))
        text += s
        if until is not None and not signalled and until in text:
            extra = then(text) if then is not None else None
            if extra:
                chunks.append((time.monotonic() - t0, f"\n[transcript: {extra}]\n"))
                text += f"\n[transcript: {extra}]\n"
            proc.send_signal(signal.SIGINT)
            signalled = True
            last = time.monotonic()
    code = proc.wait()
    lines = [ln for ln in re.split(r"[\r\n]", text) if ln.strip()]
    machine = [ln for ln in lines if MACHINE_PIP.match(ln.strip())]
    flagged = [ln for ln in lines if FLAGS.search(ln) and "[transcript:" not in ln and ln not in machine]
    return {
        "cmd": " ".join(cmd),
        "rc": code,
        "wall_s": round(time.monotonic() - t0, 1),
        "longest_silence_s": round(gap, 1),
        "flagged": flagged,
        "machine_pip_lines": len(machine),
        "chunks": chunks,
    }


def curl_without_session(text: str) -> str:
    url = re.search(r"READY (\S+)", text).group(1)  # type: ignore[union-attr]
    body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return f"curl: {r.status} {r.read()[:300]!r}"
    except urllib.error.HTTPError as exc:
        return f"curl without a session: {exc.code} {exc.read()[:400].decode()}"


def openai_snippet() -> str:
    """The quickstart's ``openai`` snippet (docs/gateway.md holds the same one: checked)."""
    qs = [b for b in python_blocks(ROOT / "docs" / "quickstart.md") if "from openai import OpenAI" in b]
    gw = [b for b in python_blocks(ROOT / "docs" / "gateway.md") if "from openai import OpenAI" in b]
    assert qs and gw and qs[0] == gw[0], "the quickstart's and gateway.md's openai snippets differ: run both"
    return qs[0]


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--home", required=True, help="a fresh ROLLOUT_SDK_HOME (created)")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="a regex: run only the commands it matches")
    p.add_argument("--readme-install", action="store_true", help="first run the README's first line as written")
    p.add_argument("--venv-has-torch", action="store_true", help="the fresh clone's .venv holds only torch")
    p.add_argument("--readme-tests", action="store_true", help="last, the README's second line (pytest) as written")
    p.add_argument("--burner", action="store_true", help="one CPU burner beside each command (not pip, not pytest)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still kills its burner (finally)
    Path(args.home).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, ROLLOUT_SDK_HOME=args.home, PYTHONUNBUFFERED="1")
    env.pop("ROLLOUT_SDK_TEST_HOME", None)
    python = sys.executable
    install: list[tuple[str, list[str], dict]] = []
    if args.readme_install:
        if (ROOT / ".venv").exists() and not args.venv_has_torch:
            p.error(f"--readme-install wants a fresh clone: {ROOT / '.venv'} exists")
        line = re.findall(r"^    (python3 -m venv .*)$", (ROOT / "README.md").read_text(), re.M)[0]
        install = [(f"README line 1: {line}", ["bash", "-c", line], {})]
        python = str(ROOT / ".venv" / "bin" / "python")
        env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env['PATH']}"  # `rollout-sdk`, `pip` of that venv
    exe = [python, "-m", "rollout_sdk"]
    home = Path(args.home)
    snippet_rows: list[tuple[str, dict]] = []

    def run_snippet(port: int):
        def then(text: str) -> str:
            path = scripts / "openai_snippet.py"
            path.write_text(openai_snippet().replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
            r = run([python, str(path)], env, burner=False)  # the burner of the gateway's row runs already
            snippet_rows.append(("quickstart / gateway.md openai snippet (against that gateway)", r))
            out = "".join(c for _, c in r["chunks"]).strip()
            return f"openai snippet: exit {r['rc']}, {r['wall_s']}s: {out[-300:]!r}"

        return then

    gw_port, serve_port = harness.free_port(), harness.free_port()
    scripts = Path(args.home) / "scripts"
    scripts.mkdir(exist_ok=True)
    blocks = [("README example", python_blocks(ROOT / "README.md")[0])]
    qs = python_blocks(ROOT / "docs" / "quickstart.md")
    blocks += [(f"quickstart python block {i + 1}", b) for i, b in enumerate(qs) if "asyncio.run(main())" in b]
    commands: list[tuple[str, list[str], dict]] = [
        *install,
        ("rollout-sdk demo", [*exe, "demo"], {}),
        ("rollout-sdk demo --rl", [*exe, "demo", "--rl"], {}),
        ("rollout-sdk make-model tiny", [*exe, "make-model", "tiny"], {}),
        ("rollout-sdk make-model tool", [*exe, "make-model", "tool"], {}),
        ("rollout-sdk make-model tool-undertrained", [*exe, "make-model", "tool-undertrained"], {}),
        ("rollout-sdk serve --engine cpu", [*exe, "serve", "--engine", "cpu"], {"until": "READY "}),
        ("rollout-sdk gateway", [*exe, "gateway"], {"until": "READY ", "then": curl_without_session}),
        ("rollout-sdk secret --out job.secret", [*exe, "secret", "--out", str(home / "job.secret")], {}),
        (
            "rollout-sdk serve --engine cpu --address-file /tmp/server.addr",
            [*exe, "serve", "--engine", "cpu", "--address-file", str(home / "server.addr")],
            {"until": "READY "},
        ),
        (
            'rollout-sdk serve --engine cpu --model "$(rollout-sdk make-model tool)" --port 5555',
            shell(f"serve --engine cpu --model {TOOL} --port {serve_port}"),
            {"until": "READY "},
        ),
        ("pip install openai", ["pip", "install", "openai"], {"pip": True}),
        (
            'rollout-sdk gateway --engine-model-path "$(rollout-sdk make-model tool)" --port 8000',
            shell(f"gateway --engine-model-path {TOOL} --port {gw_port}"),
            {"until": "READY ", "then": run_snippet(gw_port)},
        ),
        ("python examples/grpo_tools.py", [python, "examples/grpo_tools.py"], {}),
        ("python examples/tool_agent.py", [python, "examples/tool_agent.py"], {}),
        ("python examples/tool_agent.py --scripted", [python, "examples/tool_agent.py", "--scripted"], {}),
        ("python examples/gateway_trainer.py", [python, "examples/gateway_trainer.py"], {}),
        ("python examples/vl_trainer.py --steps 2", [python, "examples/vl_trainer.py", "--steps", "2"], {}),
        ("python examples/custom_trainer.py", [python, "examples/custom_trainer.py"], {}),
        (
            "torchrun --standalone --nproc-per-node 2 examples/custom_trainer.py --steps 2",
            [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "examples/custom_trainer.py",
                "--steps",
                "2",
            ],
            {},
        ),
    ]
    commands.append(
        (
            "torchrun --standalone --nproc-per-node 4 examples/driver.py --tp 2 --requests 100",
            [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "4",
                "examples/driver.py",
                "--tp",
                "2",
                "--requests",
                "100",
            ],
            {},
        )
    )
    # the one-line mistakes the docs promise (README/quickstart: checked before any work, exit 2)
    mistakes = (
        ["serve", "--port", "99999"],
        ["serve", "--potr", "1"],
        ["--log-level", "bogus", "demo"],
        ["serve", "--address-file", "/no/such/dir/addr"],
        ["demo", "--servers", "127.0.0.1:36471"],
        ["serve", "--engine", "sglang"],
    )
    commands += [(f"rollout-sdk {' '.join(argv)}", [*exe, *argv], {}) for argv in mistakes]
    for name, code in blocks:
        path = scripts / (re.sub(r"\W+", "_", name) + ".py")
        path.write_text(code)
        commands.append((name, [python, str(path)], {}))
    if args.readme_tests:
        line = re.findall(r"^    (python3 -m venv .*pytest)$", (ROOT / "README.md").read_text(), re.M)[0]
        commands.append((f"README line 2: {line}", ["bash", "-c", line], {"pip": True, "limit_s": 5400}))
    rows = []
    with open(args.out, "w") as out:
        for name, cmd, kw in commands:
            if args.only and not re.search(args.only, name):
                continue
            pip = kw.pop("pip", False) or name.startswith("README line 1")
            r = run(cmd, env, burner=args.burner and not pip, **kw)
            done = [(name, r), *snippet_rows]
            snippet_rows.clear()
            for label, r in done:
                rows.append((label, r))
                out.write(f"\n$ {label}  (load {r['load']}{', one CPU burner' if args.burner and not pip else ''})\n")
                for t, s in r["chunks"]:
                    for piece in re.split(r"(?<=[\r\n])", s):
                        if piece.strip():
                            out.write(f"[{t:7.1f}s] {piece.rstrip()}\n")
                out.write(f"[exit {r['rc']}, {r['wall_s']}s, longest silence {r['longest_silence_s']}s]\n")
                out.flush()
                print(
                    f"{label:80s} rc={r['rc']:<4} {r['wall_s']:7.1f}s  silence {r['longest_silence_s']:5.1f}s  "
                    f"load {r['load']:4.1f}  flagged {len(r['flagged'])}  machine pip lines {r['machine_pip_lines']}",
                    flush=True,
                )
                for f in r["flagged"]:
                    print(f"    flagged: {f[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
