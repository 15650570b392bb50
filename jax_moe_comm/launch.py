"""Start N processes with jax.distributed set up: `python -m jax_moe_comm.launch -n N -- CMD`.

One node. Each child gets JAX_COORDINATOR_ADDRESS (read by jax.distributed.initialize()
itself), JAX_NUM_PROCESSES and JAX_PROCESS_ID (read once jax_moe_comm is imported), on GPU
JAX_LOCAL_DEVICE_IDS=0 and its own CUDA_VISIBLE_DEVICES (one GPU each by default, or all on
GPU 0 with --oversubscribe: CUDA MPS started and stopped here, 100/N of the SMs per process),
on CPU JAX_PLATFORMS=cpu and JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo. So a script that calls
`jax.distributed.initialize()` with no arguments (after `import jax_moe_comm`), or
`jax_moe_comm.distributed.initialize()`, runs unchanged. The same values are also exported as
JAX_MOE_COMM_{COORDINATOR,NUM_PROCESSES,PROCESS_ID}. Output lines are prefixed with the rank;
the gRPC messages JAX logs when its coordination client shuts down are dropped (--show-grpc).
If one rank fails or the timeout passes, the others are sent SIGTERM, then SIGKILL, and the
launcher exits non-zero. --keep-going lets the others run on after a rank fails (what survivors
of a dead process see: examples/serve_decode.py --kill-at); the exit code is then the first
failing rank's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# Safe defaults for NVSHMEM on one node (DESIGN section 9); a caller's own values win.
NVSHMEM_DEFAULTS = {
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_NVLS": "1",  # never NVLink multicast on shared hosts
    "NVSHMEM_SYMMETRIC_SIZE": "2G",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
ONE_GPU_DEFAULTS = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


class Mps:
    """A private CUDA MPS control daemon for the duration of the run."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="jmc_mps_")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}
        for d in self.env.values():
            os.makedirs(d)

    def start(self):
        env = {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": "0"}
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
        time.sleep(1.0)

    def stop(self):
        env = {**os.environ, **self.env}
        try:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env,
                           timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class ShutdownNoise:
    """Drops the gRPC block JAX's coordination client logs when its WatchTasks call ends at
    shutdown: a `WatchTasksAsync failed ... CANCELLED` (its own shutdown) or `UNAVAILABLE ...
    Connection refused` (the coordinator, rank 0, left first) warning and a 4-5 line trace, on
    every rank at every normal exit with jax 0.11 (issue 9: "no wall of gRPC errors"). Which
    rank failed, and why, the launcher reports itself; `--show-grpc` keeps the lines."""

    START = "WatchTasksAsync failed"
    TRACE = ("Additional GRPC error information", ":CANCELLED:", ":UNAVAILABLE:",
             "=== Source Location Trace", "grpc_util.h")

    def __init__(self):
        self.in_block = False
        self.dropped = 0  # blocks

    def keep(self, line: str) -> bool:
        if self.START in line:
            self.in_block = True
            self.dropped += 1
            return False
        if self.in_block:
            text = line.strip()
            if not text or any(t in text for t in self.TRACE):
                return False
            self.in_block = False
        return True


def _pump(rank: int, stream, out, noise: ShutdownNoise | None = None):
    for line in iter(stream.readline, ""):
        if noise is not None and not noise.keep(line):
            continue
        out.write(f"[rank {rank}] {line}")
        out.flush()
    stream.close()


def _stop_all(procs, grace_s: float = 5.0):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        while p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()


def run(num_processes: int, cmd: list[str], *, oversubscribe: bool = False,
        timeout_s: float = 600.0, platform: str = "auto", out=sys.stdout,
        show_grpc: bool = False, keep_going: bool = False) -> int:
    """Run `cmd` N times; returns 0 when every rank exited 0. keep_going: a failed rank does
    not stop the others (they still end at the timeout)."""
    if num_processes < 1:
        raise ValueError(f"-n {num_processes}: need at least one process")
    if not cmd:
        raise ValueError("no command given after --")
    gpus = gpu_count() if platform in ("auto", "gpu") else 0
    if platform == "gpu" and gpus == 0:
        raise RuntimeError("--platform gpu, but nvidia-smi lists no GPU")
    use_gpu = gpus > 0
    if use_gpu and not oversubscribe and num_processes > gpus:
        raise RuntimeError(f"-n {num_processes} needs {num_processes} GPUs, {gpus} present; "
                           "use --oversubscribe to run them all on GPU 0 under MPS")
    coordinator = f"127.0.0.1:{free_port()}"
    base = dict(os.environ)
    mps = None
    if use_gpu:
        for key, value in NVSHMEM_DEFAULTS.items():
            base.setdefault(key, value)
        if oversubscribe or gpus == 1:
            for key, value in ONE_GPU_DEFAULTS.items():
                base.setdefault(key, value)
        if oversubscribe and num_processes > 1:
            mps = Mps()
            mps.start()
            base.update(mps.env)
            base["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, 100 // num_processes))
    else:
        base["JAX_PLATFORMS"] = "cpu"
        base["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"  # XLA:CPU collectives across processes
    base["NVSHMEM_DISABLE_NVLS"] = "1"
    base["PYTHONUNBUFFERED"] = "1"
    base.setdefault("PYTHONFAULTHANDLER", "1")  # a segfaulting rank prints its stack

    procs, pumps = [], []
    noise = [None if show_grpc else ShutdownNoise() for _ in range(num_processes)]
    try:
        for rank in range(num_processes):
            env = dict(base)
            env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(num_processes),
                       JAX_PROCESS_ID=str(rank), JAX_MOE_COMM_COORDINATOR=coordinator,
                       JAX_MOE_COMM_NUM_PROCESSES=str(num_processes),
                       JAX_MOE_COMM_PROCESS_ID=str(rank))
            if use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = "0" if oversubscribe else str(rank)
                env["JAX_LOCAL_DEVICE_IDS"] = "0"  # this process's one visible GPU
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, noise[rank]),
                                 daemon=True)
            t.start()
            pumps.append(t)
        deadline = time.time() + timeout_s
        failures = []  # (rank, code) in the order the launcher saw them exit
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in (r for r, _ in failures):
                    failures.append((rank, code))
                    then = "the others run on" if keep_going else "stopping the others"
                    out.write(f"[launch] rank {rank} exited with {code}; {then}\n")
            if failures and (not keep_going or all(c is not None for c in codes)):
                _stop_all(procs)
                code = failures[0][1]
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if time.time() > deadline:
                out.write(f"[launch] timeout after {timeout_s:.0f} s; stopping every rank\n")
                _stop_all(procs)
                return 124
            time.sleep(0.05)
    finally:
        _stop_all(procs)
        for t in pumps:
            t.join(timeout=5)
        if mps is not None:
            mps.stop()
        hidden = sum(n.dropped for n in noise if n is not None)
        if hidden:
            out.write(f"[launch] hid {hidden} gRPC WatchTasks shutdown message(s) of JAX's "
                      "coordination service (--show-grpc shows them)\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m jax_moe_comm.launch -n N [--oversubscribe] [--timeout S] "
              "-- CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m jax_moe_comm.launch")
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--oversubscribe", action="store_true",
                        help="run every process on GPU 0 under CUDA MPS")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--show-grpc", action="store_true",
                        help="keep the gRPC WatchTasks messages JAX logs at shutdown")
    parser.add_argument("--keep-going", action="store_true",
                        help="a rank that fails does not stop the others; exit code: the "
                        "first failing rank's")
    args = parser.parse_args(argv[:split])
    return run(args.num_processes, argv[split + 1:], oversubscribe=args.oversubscribe,
               timeout_s=args.timeout, platform=args.platform, show_grpc=args.show_grpc,
               keep_going=args.keep_going)


if __name__ == "__main__":
    sys.exit(main())
