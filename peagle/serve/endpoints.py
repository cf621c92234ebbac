"""Endpoints on one machine, as SageMaker's deploy / InService / delete cycle:

  peagle deploy NAME [--port P] [--name ENDPOINT] [serve flags...]   start a detached `peagle serve`, return at once
  peagle endpoints [--json]                                          name, status, URL, model, speculative config
  peagle delete ENDPOINT                                             stop it (SIGTERM, then SIGKILL), free its port

State lives in $PEAGLE_HOME/endpoints/<endpoint>.json with the server's output in <endpoint>.log, so it survives
the shell that deployed it. Status: Creating (process alive, /health not yet 200), InService (/health is 200),
Failed (the process is gone; the reason is the last error line of its log).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from peagle import cli_args
from peagle.model.home import peagle_home


def endpoints_dir() -> Path:
    d = peagle_home() / "endpoints"
    d.mkdir(parents=True, exist_ok=True)
    return d


def register(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "deploy":
        parser.add_argument("target", metavar="NAME", help="a preset (`peagle models`), model folder or cached id")
        parser.add_argument("--name", dest="endpoint", help="endpoint name (default: derived from NAME)")
        parser.add_argument("--port", type=cli_args.port, help="port (default: the first free one from 8000)")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                            help="further `peagle serve` flags, e.g. --speculative-config JSON --max-num-seqs 16")
        parser.set_defaults(func=deploy)
    elif name == "endpoints":
        parser.add_argument("--json", action="store_true", help="print as JSON")
        parser.set_defaults(func=list_endpoints)
    elif name == "delete":
        parser.add_argument("endpoint", metavar="ENDPOINT")
        parser.add_argument("--timeout", type=cli_args.positive_float, default=30.0,
                            help="seconds to wait after SIGTERM (default 30)")
        parser.set_defaults(func=delete)


# ------------------------------------------------------------------------------------------------------------
# process helpers


def _proc_stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces: split after its closing parenthesis
    return raw[raw.rindex(")") + 2:].split()


def process_alive(pid: int, start_time: str | None = None) -> bool:
    """True for a live (not zombie) process whose start time matches (so a reused pid is not mistaken)."""
    st = _proc_stat(pid)
    if st is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if st[0] in ("Z", "X"):
        return False
    return start_time is None or st[19] == start_time


def _start_time(pid: int) -> str | None:
    st = _proc_stat(pid)
    return st[19] if st else None


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _pick_port(host: str, taken: set[int]) -> int:
    for port in range(8000, 8100):
        if port not in taken and port_free(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _health(url: str, timeout: float = 1.0) -> int | None:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def _failure_reason(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "the server process exited (no log)"
    for ln in reversed(lines):
        if "error" in ln.lower() or "Error" in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "the server process exited without output"


# ------------------------------------------------------------------------------------------------------------
# state


def load_all() -> list[dict]:
    out = []
    for f in sorted(endpoints_dir().glob("*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def status(ep: dict) -> tuple[str, str | None]:
    """(Creating | InService | Failed, reason)."""
    if not process_alive(ep["pid"], ep.get("start_time")):
        return "Failed", _failure_reason(Path(ep["log"]))
    code = _health(ep["url"])
    if code == 200:
        return "InService", None
    return "Creating", None


def _endpoint_name(target: str) -> str:
    base = Path(target).name if Path(target).expanduser().exists() else target.split("/")[-1]
    return re.sub(r"[^a-zA-Z0-9-]+", "-", base).strip("-").lower() or "endpoint"


def _spec_from_args(target: str, serve_args: list[str]) -> dict | None:
    """The speculative config the server will run, for display, decided as `peagle serve` decides it (its own log
    is authoritative). Raises SpeculativeConfigError for a config the server would refuse."""
    from peagle.config import SpeculativeConfigError
    from peagle.model.speculation import resolve_speculation
    from peagle.serve import catalog

    text = None
    for i, a in enumerate(serve_args):
        if a == "--speculative-config":
            if i + 1 == len(serve_args):
                raise SpeculativeConfigError("--speculative-config needs a value: JSON, or none")
            text = serve_args[i + 1]
        elif a.startswith("--speculative-config="):
            text = a.split("=", 1)[1]
    preset = catalog.find(target)
    has_model = preset is not None and preset.model is not None
    spec = resolve_speculation(preset.model if preset else target, text,
                               preset=preset.speculative_config if has_model else None, local=False).config
    return spec.to_dict() if spec is not None else None


# ------------------------------------------------------------------------------------------------------------
# commands


def _own_flags(args) -> None:
    """argparse's REMAINDER swallows deploy's own flags when they follow NAME: take them back."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--name", dest="endpoint")
    own.add_argument("--port", type=cli_args.port)
    own.add_argument("--host")
    known, rest = own.parse_known_args([a for a in (args.serve_args or []) if a != "--"])
    for key in ("endpoint", "port", "host"):
        if getattr(known, key) is not None:
            setattr(args, key, getattr(known, key))
    args.serve_args = rest


def deploy(args) -> int:
    _own_flags(args)
    name = args.endpoint or _endpoint_name(args.target)
    state_file = endpoints_dir() / f"{name}.json"
    if state_file.exists():
        ep = json.loads(state_file.read_text())
        if process_alive(ep["pid"], ep.get("start_time")):
            print(f"peagle deploy: error: endpoint {name!r} already exists ({ep['url']}); `peagle delete {name}` "
                  "first or pick another --name", file=sys.stderr)
            return 2
    taken = {ep["port"] for ep in load_all() if process_alive(ep["pid"], ep.get("start_time"))}
    port = args.port or _pick_port(args.host, taken)
    if not port_free(args.host, port):
        print(f"peagle deploy: error: port {port} is in use", file=sys.stderr)
        return 2
    serve_args = args.serve_args
    from peagle.config import SpeculativeConfigError

    try:
        spec = _spec_from_args(args.target, serve_args)
    except SpeculativeConfigError as e:
        print(f"peagle deploy: error: {e}", file=sys.stderr)
        return 2
    target = None if args.target in ("default",) else args.target
    cmd = [sys.executable, "-m", "peagle.cli", "serve", *([target] if target else []),
           "--host", args.host, "--port", str(port), *serve_args]
    log = endpoints_dir() / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://{args.host}:{port}"
    ep = {"name": name, "target": args.target, "model": args.target, "url": url, "host": args.host, "port": port,
          "pid": proc.pid, "start_time": _start_time(proc.pid), "command": cmd, "log": str(log),
          "speculative_config": spec, "created": time.time()}
    tmp = state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ep, indent=2))
    tmp.replace(state_file)
    print(f"peagle deploy: endpoint {name} is Creating at {url} (pid {proc.pid}, log {log}); "
          f"`peagle endpoints` shows when it is InService")
    return 0


def list_endpoints(args) -> int:
    rows = []
    for ep in load_all():
        st, reason = status(ep)
        rows.append({**ep, "status": st, "reason": reason})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no endpoints; create one with `peagle deploy NAME`")
        return 0
    table = [("NAME", "STATUS", "URL", "MODEL", "SPECULATIVE CONFIG")]
    for r in rows:
        st = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
        spec = json.dumps(r["speculative_config"]) if r["speculative_config"] else "none"
        table.append((r["name"], st, r["url"], r["model"], spec))
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t[:4], widths)) + "  " + t[4])
    return 0


def delete(args) -> int:
    state_file = endpoints_dir() / f"{args.endpoint}.json"
    if not state_file.exists():
        have = ", ".join(ep["name"] for ep in load_all()) or "none"
        print(f"peagle delete: error: no endpoint {args.endpoint!r} (endpoints: {have})", file=sys.stderr)
        return 2
    ep = json.loads(state_file.read_text())
    pid = ep["pid"]
    if process_alive(pid, ep.get("start_time")):
        try:
            os.killpg(pid, signal.SIGTERM)  # its own session: the server and anything it started
        except ProcessLookupError:
            pass
        end = time.time() + args.timeout
        while process_alive(pid, ep.get("start_time")) and time.time() < end:
            time.sleep(0.1)
        if process_alive(pid, ep.get("start_time")):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while process_alive(pid, ep.get("start_time")):
                time.sleep(0.1)
    end = time.time() + 10
    while not port_free(ep["host"], ep["port"]) and time.time() < end:
        time.sleep(0.1)
    state_file.unlink(missing_ok=True)
    Path(ep["log"]).unlink(missing_ok=True)
    print(f"peagle delete: endpoint {args.endpoint} deleted (port {ep['port']} free)")
    return 0
