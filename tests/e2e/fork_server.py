"""train.py runs forked from a process that has imported torch and the package once (one per pytest worker).

A tiny run's process spends most of its CPU importing: torch, torch.distributed's tensor, FSDP, checkpoint and
pipelining modules, mmengine, pydantic and this package take about 3.5 s of CPU, the run itself 1 to 3 s, and
torchrun's launcher imports torch once more. On CI's two cores that import cost is most of the suite. Here a
server process imports it all once; each run is a `fork` of it whose child sets its environment, working
folder and argv, points stdout and stderr at files, and runs the script as `python script.py` would
(`runpy`, `__main__`, `SystemExit` as the exit code, atexit handlers run).

Under "torchrun" the server forks one child per rank with the variables torchrun's agent gives each worker
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...; no agent store: rank 0 hosts the TCP store as under
`init_process_group`'s env:// rendezvous), and, as the agent does, stops the other ranks when one fails.

A module runs as `python -m module` would (`runpy.run_module`): the tools. A run can be started and left
running (`start`, then `poll` / `wait`, with signals sent to its pids): the tests that kill or interrupt a run.

Forking is safe here because the server holds one thread and has run no kernel (checked at start-up: a
second thread makes the runner fall back to plain subprocesses). What a fork cannot give a run, the runner
keeps on real processes: environment variables read when python, torch or the C library start (e.g.
ATEN_CPU_CAPABILITY, MALLOC_*, OMP_*), and multi-process runs expected to fail (their exit codes and messages
as torchrun reports them).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# What every run imports (and what costs): imported once, before any fork.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.elastic.multiprocessing.errors",
    "internlm_offload.launch",
    "internlm_offload.builder",
    "internlm_offload.planner.preflight",
    "internlm_offload.engine.checkpoint",
    "internlm_offload.engine.trainer",
    # what a run still imported after the fork (0.1 to 0.2 s of CPU each): the checkpoint's file system, the
    # native families' models
    "torch.distributed.checkpoint._fsspec_filesystem",
    "internlm_offload.model.families.internlm2.model",
    "internlm_offload.model.families.deepseek_v3.model",
    # The DeepSeek-V3 family and Hugging Face models read their config through transformers: its import and the
    # auto classes' mapping take about 1.1 s of CPU per process, every rank of those runs (a third of the e2e files).
    "transformers",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    # LoRA's adapters (model/lora.py): peft, which imports bitsandbytes, about 1.5 s of CPU per rank of a LoRA run
    "peft",
)


class ForkServer:
    """The client: one server process, runs sent one at a time (a lock keeps threads' requests apart)."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-u", __file__],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = json.loads(self._proc.stdout.readline() or "{}")
        self.usable = ready.get("threads") == 1

    def run(self, target: dict[str, str], argv: list[str], rank_envs: list[dict[str, str]], cwd: Path, out: Path,
            timeout: float) -> int:  # fmt: skip
        """Run `target` ({"script": path} or {"module": name}) with `argv` once per entry of `rank_envs`, stdout
        and stderr appended to `out`.stdout / .stderr; the exit code (a failing rank's, as torchrun reports the
        first failure; -9 past `timeout`)."""
        return self.wait(self.start(target, argv, rank_envs, cwd, out), timeout)

    def start(self, target: dict[str, str], argv: list[str], rank_envs: list[dict[str, str]], cwd: Path,
              out: Path) -> list[int]:  # fmt: skip
        """`run` without waiting: the ranks' pids (to `poll`, `wait` for, or signal)."""
        request = {"op": "start", **target, "argv": argv, "envs": rank_envs, "cwd": str(cwd), "out": str(out)}
        return self._ask(request)["pids"]

    def wait(self, pids: list[int], timeout: float) -> int:
        return self._ask({"op": "wait", "pids": pids, "timeout": timeout})["returncode"]

    def poll(self, pids: list[int]) -> int | None:
        """The exit code once every rank has ended (or one has failed: the others are then stopped), else None."""
        return self._ask({"op": "poll", "pids": pids})["returncode"]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError("the fork server died")
        return json.loads(reply)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


def torchrun_envs(base: dict[str, str], nproc: int) -> list[dict[str, str]]:
    """Each rank's environment as torchrun --standalone gives it (one node, no restarts)."""
    with socket.socket() as sock:  # as --standalone does: a free port, taken by rank 0's store right after
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = {
        "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": f"fork{port}",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }  # fmt: skip
    return [{**base, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]


# ---------------------------------------------------------------------------------------------------- the server


def _child(request: dict[str, Any], env: dict[str, str]) -> None:
    """In the forked child: become `python script argv` under `env` and exit with its code."""
    code: Any = 1
    try:
        out = request["out"]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, suffix in ((1, ".stdout"), (2, ".stderr")):
            os.dup2(os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        try:
            if "module" in request:  # python -m: the working folder first on the path
                sys.argv = ["-m", *request["argv"]]
                sys.path[0] = os.getcwd()
                sys.modules.pop(request["module"], None)  # runs afresh as __main__, as in a new process
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            else:
                script = request["script"]
                sys.argv = [script, *request["argv"]]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException as exc:  # noqa: BLE001  an uncaught exception: python prints it and exits 1
            traceback.print_exception(type(exc), exc, _own_frames(exc.__traceback__))
            code = 1
        import atexit

        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _own_frames(tb: Any) -> Any:
    """The traceback from the script's first frame on: without this file's and runpy's, as python prints it."""
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
        tb = tb.tb_next
    return tb


def _poll(pids: list[int], codes: dict[int, int]) -> int | None:
    """Reap what has ended (into `codes`); on the first failure stop the others (torchrun's agent does). The
    run's code once every rank has ended (a failing rank's, else 0); None while one runs."""
    for pid in pids:
        if pid in codes:
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            first_failure = all(codes.get(p, 0) == 0 for p in pids)
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and first_failure:
                _signal_rest(pids, codes, signal.SIGTERM)
    if any(pid not in codes for pid in pids):
        return None
    failed = [codes[pid] for pid in pids if codes[pid] != 0]
    return failed[0] if failed else 0


def _wait(pids: list[int], codes: dict[int, int], timeout: float) -> int:
    """Poll until the run ends; past `timeout` every rank is killed and the run's code is -9."""
    deadline = time.monotonic() + timeout
    while (code := _poll(pids, codes)) is None:
        if time.monotonic() > deadline:
            _signal_rest(pids, codes, signal.SIGKILL)
            while _poll(pids, codes) is None:
                time.sleep(0.02)
            return -9
        time.sleep(0.02)
    return code


def _signal_rest(pids: list[int], codes: dict[int, int], signum: int) -> None:
    for pid in pids:
        if pid not in codes:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def serve() -> None:
    import importlib

    sys.path[0] = os.getcwd()  # the repository, as for train.py there: its package, not another checkout's
    for name in PRELOAD:
        importlib.import_module(name)
    print(json.dumps({"threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0}))
    sys.stdout.flush()
    codes: dict[int, int] = {}  # exit codes of reaped children, by pid
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pids = []
            for env in request["envs"]:
                pid = os.fork()
                if pid == 0:
                    _child(request, env)
                codes.pop(pid, None)  # a reused pid: an earlier child's code is not this one's
                pids.append(pid)
            reply: dict[str, Any] = {"pids": pids}
        elif request["op"] == "poll":
            reply = {"returncode": _poll(request["pids"], codes)}
        else:
            reply = {"returncode": _wait(request["pids"], codes, request["timeout"])}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
