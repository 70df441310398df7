"""Shared pieces of the Python tests: a private runtime directory per test, a raw
protocol viewer, small models, and no run left active between tests."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest
import torch

import headroom
from headroom import _run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    """Each test serves in its own runtime directory (0700, as the server demands)."""
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("HEADROOM_RUNTIME_DIR", str(d))
    yield d
    kill_jobs()
    current = _run._current
    if current is not None and not current.ended:
        current.fail("left active by a test")


def headroom_bin() -> str:
    path = os.environ.get("HEADROOM_BIN", str(ROOT / "target" / "release" / "headroom"))
    if not Path(path).exists():
        pytest.fail(f"the headroom binary {path} is missing; run the tests through ./dev test")
    return path


class Viewer:
    """A client of a run's stream, speaking docs/PROTOCOL.md over the Unix socket."""

    def __init__(self, path: str, timeout: float = 10.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.file = self.sock.makefile("rb")
        self.send({"kind": "hello", "protocol": "1.0", "client": "pytest", "want": "stream"})
        self.hello = self.read()
        assert self.hello["kind"] == "hello", self.hello
        self.seen: list[dict] = []

    def send(self, obj: dict) -> None:
        self.sock.sendall((json.dumps(obj) + "\n").encode())

    def command(self, command: str, **fields) -> None:
        self.send({"kind": "command", "command": command, **fields})

    def read(self) -> dict:
        line = self.file.readline()
        if not line:
            raise EOFError("the run closed the stream")
        return json.loads(line)

    def until(self, pred, timeout: float = 20.0) -> dict:
        """Reads records until one satisfies `pred`; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.read()
            self.seen.append(r)
            if pred(r):
                return r
        raise TimeoutError(f"no matching record within {timeout} s; last: {self.seen[-3:]}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def steer(get_run, commands, answers: dict, errors: list) -> None:
    """On a thread beside a framework's training loop: waits for its run (`get_run()`),
    sends `commands` (in order; a name, or a name and its fields) after the third step,
    each once the one before was answered (`answers[name]`: its record), then waits for
    the run's end. What goes wrong lands in `errors`, for the test to report."""
    try:
        deadline = time.monotonic() + 60
        while get_run() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        v = Viewer(get_run().socket)
        v.until(lambda r: r["kind"] == "step" and r["step"] >= 3)
        for c in commands:
            c, fields = (c, {}) if isinstance(c, str) else c
            v.command(c, **fields)
            answers[c] = v.until(
                lambda r, c=c: (
                    (r["kind"] == "command_applied" and r["command"]["command"] == c)
                    or (c == "stop" and r["kind"] == "status" and r["status"] == "stopping")
                )
            )
        v.until(lambda r: r["kind"] == "finished")
    except Exception as e:  # pragma: no cover - reported by the test
        errors.append(e)


def assert_params_close(got, want, tol: float) -> None:
    """Each parameter of `got` within `tol` of `want`'s: the largest absolute difference
    of any element, the one measure of every test that compares two trainings. `got` and
    `want` are modules (their parameters in order, named after `want`'s: a compiled or
    wrapped module names them otherwise) or dicts of tensors by name (state_dicts)."""
    if isinstance(want, torch.nn.Module):
        named = list(want.named_parameters())
        others = list(got.parameters())
        assert len(others) == len(named), f"{len(others)} parameters against {len(named)}"
        pairs = [(name, g, w) for (name, w), g in zip(named, others)]
    else:
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
        pairs = [(name, got[name], w) for name, w in want.items()]
    for name, g, w in pairs:
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} against {tuple(w.shape)}"
        d = (g.detach() - w.detach()).abs().max().item() if w.numel() else 0.0
        assert d <= tol, f"{name}: differs by {d:.2e} (tolerance {tol:.0e})"


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def kinds(log: Path, kind: str) -> list[dict]:
    return [r for r in records(log) if r["kind"] == kind]


def live_records(log: Path, kind: str | None = None) -> list[dict]:
    """The records (of `kind`) of a log its run is still writing: its complete lines
    only, since the writer may be in the middle of the last one."""
    if not log.exists():
        return []
    text = log.read_text()
    done = text[: text.rfind("\n") + 1]
    found = [json.loads(line) for line in done.splitlines() if line.strip()]
    return [r for r in found if kind is None or r["kind"] == kind]


def leave(code: int) -> None:
    """A rank script's end, once its process groups are destroyed and its results written:
    out without the interpreter's teardown, where a gloo group's threads can still abort
    the process ("terminate called without an active exception", pytorch#190489; seen in
    the FSDP2 capped job and Lightning's ModelParallelStrategy, after every file was
    written). The tests judge the files, not that teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def injection_plan(spec: str, rank: int) -> dict[int, str]:
    """The rank scripts' `--inject RANK:POINT@STEP,POINT@STEP...`: this rank's points by
    step (empty for the other ranks)."""
    plan: dict[int, str] = {}
    if spec:
        r, points = spec.split(":")
        if int(r) == rank:
            for item in points.split(","):
                point, at = item.split("@")
                plan[int(at)] = point
    return plan


class FailInBackward(torch.autograd.Function):
    """Identity whose backward asks the allocator for the impossible when armed (the
    rank scripts' injected OOMs): placed at the input side, the later layers' gradients
    are already accumulated; at the output, none are."""

    armed = False
    # Raised instead of the out-of-memory error, when set (an error that is not one).
    error: Exception | None = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if FailInBackward.armed:
            FailInBackward.armed = False
            if FailInBackward.error is not None:
                raise FailInBackward.error
            from headroom import _torch

            _torch.provoke_oom(g.device)
        return g


class TinyGPT(torch.nn.Module):
    """A small causal transformer over byte tokens. `branch`: two layers only the samples
    whose first token is 0 go through (registered last, so their gradients are in the
    first buckets a DDP job reduces); a micro-batch without such a sample gives them no
    gradient. Each branch weight is 5 x d x d (20 KiB at d=32): larger than two small DDP
    buckets, so a job all-reduces it alone, in chunks."""

    def __init__(
        self, vocab: int = 64, d: int = 32, t: int = 16, layers: int = 2, branch: bool = False
    ):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(t, d) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(d, vocab)
        self.hook = None
        self.branch = (
            torch.nn.Sequential(torch.nn.Linear(d, 5 * d), torch.nn.Linear(5 * d, d))
            if branch
            else None
        )

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        if self.branch is not None:
            taken = x[:, 0] == 0
            if taken.any():
                h = torch.where(taken[:, None, None], h + self.branch(h), h)
        if self.hook is not None:
            h = self.hook(h)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        return self.head(h)

    def loss(self, batch):
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class TinyCNN(torch.nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, classes),
        )

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)


def branch_batch(x: torch.Tensor, first: int) -> None:
    """Token batch `x` (in place): its first `first` samples take TinyGPT's branch, the
    others never do (a rank per share of a global batch: only rank 0's data takes it)."""
    x[:first, 0] = 0
    x[first:, 0].clamp_(min=1)


def gpt_batches(steps: int, n: int, t: int = 16, vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (n, t), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def cnn_batches(steps: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(n, 3, 16, 16, generator=g)
        y = x.mean(dim=(2, 3)).argmax(dim=1) % 4
        out.append((x, y))
    return out


def die_with_parent() -> None:
    """Asks the kernel to kill this process when its parent dies (Linux's
    PR_SET_PDEATHSIG), so no rank or child outlives a killed test run: torchrun starts
    each rank in a session of its own, where the test's process-group kill cannot reach."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def _child_setup() -> None:
    """In the child, before exec: dies with this process, and starts with SIGINT, SIGQUIT
    and SIGHUP at their defaults, as a terminal's foreground job does. A suite started in
    the background of a non-interactive shell (`cmd &`) has SIGINT and SIGQUIT ignored, one
    started under nohup SIGHUP: an ignore that every child inherits and that headroom
    rightly keeps, so the tests that send those signals would hang there."""
    import signal

    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def say(text: str) -> None:
    """Prints a line in one write: ranks share torchrun's stdout, and print's separate
    write of the newline lets two ranks' lines interleave into one."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def spawn(
    argv: list[str], new_session: bool = False, output: Path | None = None
) -> subprocess.Popen:
    """Starts `python ARGV…` in its own process (a hard cap, signals and torchrun are
    process-wide), with this directory importable (the scripts use conftest's models); it
    dies with this process. `new_session`: in a session of its own, so its children can
    be killed with it. `output`: a folder for its stdout and stderr (out.txt, err.txt)
    instead of pipes, for long runs that nobody reads while they go."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    )
    with contextlib.ExitStack() as files:
        streams: dict = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        if output is not None:
            output.mkdir(parents=True, exist_ok=True)
            streams = {
                name: files.enter_context(open(output / f"{name[3:]}.txt", "w"))
                for name in ("stdout", "stderr")
            }
        return subprocess.Popen(
            [sys.executable, *argv],
            text=True,
            env=env,
            start_new_session=new_session,
            preexec_fn=_child_setup,
            **streams,
        )


def kill_all_mentioning(text: str) -> None:
    """SIGKILLs every process whose command line holds `text` (a test's own folder): what
    a test started, however deep, whatever session it put itself in."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), 9)


_jobs: list[subprocess.Popen] = []


def torchrun(nproc: int, script: Path, *args: str) -> subprocess.Popen:
    """`torchrun --standalone` of a rank script (this directory's), in a session of its
    own; its stdout and stderr go to files in its --out folder (out.txt, err.txt): a pipe
    nobody drains while the ranks train can fill and stall them. Killed with every rank
    when the test ends."""
    out = Path(args[args.index("--out") + 1])
    job = spawn(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(Path(__file__).resolve().parent / script),
            *args,
        ],
        new_session=True,
        output=out,
    )
    job.out = out
    _jobs.append(job)
    return job


def kill_jobs() -> None:
    """Kills the test's torchrun jobs and every rank of them (torchrun puts each rank in a
    session of its own: found by the job's folder), so no rank of a failed test goes on
    training beside the next."""
    while _jobs:
        job = _jobs.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, 9)
        kill_all_mentioning(str(job.out))


def output(job: subprocess.Popen) -> tuple[str, str]:
    """A torchrun job's stdout and stderr so far."""
    return (job.out / "out.txt").read_text(), (job.out / "err.txt").read_text()


def wait(job: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Waits for the job to end; its stdout and stderr."""
    job.wait(timeout=timeout)
    return output(job)


def finish(job: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    """Waits for a job that must succeed; its stdout and stderr."""
    try:
        out, err = wait(job, timeout)
    except subprocess.TimeoutExpired as e:
        job.kill()
        out, err = wait(job, 60)
        raise AssertionError(
            f"the job hung (killed after {timeout} s):\n{out}\n{err[-4000:]}"
        ) from e
    assert job.returncode == 0, f"rc {job.returncode}\n{out}\n{err[-6000:]}"
    return out, err


def in_fresh_process(module: str, body: str, tmp_path) -> None:
    """Runs `module.body(tmp_path)` in a process of its own: these tests allocate and free
    large tensors, which moves glibc's mmap threshold for the rest of the process (later
    tests' peaks would then come from reused heap), and measure peaks that an earlier
    test's retained heap would distort."""
    p = spawn(["-c", f"import pathlib, {module}; {module}.{body}(pathlib.Path({str(tmp_path)!r}))"])
    out, err = p.communicate(timeout=300)
    print(out)
    assert p.returncode == 0, err


__all__ = ["headroom"]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The interpreter ./dev gives cargo (PYO3_PYTHON): pyo3's build then matches the one
    # `./dev test` already compiled, and only the extension itself is linked again.
    python = os.environ.get("PYO3_PYTHON", sys.executable)
    subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "-i", python] + ["--out", str(out)],
        cwd=ROOT / "py",
        check=True,
    )
    (found,) = out.glob("headroom-*.whl")
    return found


def spawn_on_pty(argv: list[str], cols: int = 160, rows: int = 50, env: dict | None = None):
    """Starts `argv` on a new pseudo-terminal of that size (in `env`, else this process's
    environment); returns (pid, master fd)."""
    pid, fd = pty.fork()
    if pid == 0:
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = dict(os.environ if env is None else env, TERM="xterm-256color")
        os.execve(argv[0], argv, env)
    return pid, fd


def _squash(line: str) -> str:
    return re.sub(" +", " ", line)


class Screen:
    """A terminal on a pty's master side: what the program wrote (raw, for escape
    sequences) and the grid it drew, kept by pyte as a terminal keeps it. A TUI writes
    only the cells that changed, so text that moved or changed in place is never whole in
    the raw bytes; the grid is what a user reads."""

    def __init__(self, fd: int, cols: int = 160, rows: int = 50):
        self.fd = fd
        self.data = b""
        self._grid = pyte.Screen(cols, rows)
        self._stream = pyte.ByteStream(self._grid)
        # Every line the grid has shown since the start : an event
        # that scrolled away between two reads was still on the screen.
        self.seen: set[str] = set()

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            r, _, _ = select.select([self.fd], [], [], 0.05)
            if r:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                self.data += chunk
                self._stream.feed(chunk)
                self.seen.update(_squash(line) for line in self._grid.display)

    def text(self) -> str:
        """The screen as it stands, a line per row, trailing blanks cut."""
        return "\n".join(line.rstrip() for line in self._grid.display)

    def shows(self, text: str) -> bool:
        """Whether the screen shows `text` on one of its rows now (a run of spaces matches
        any run: the layout pads columns)."""
        text = _squash(text)
        return any(text in _squash(line) for line in self._grid.display)

    def wait_for(self, text: str, timeout: float = 60) -> bool:
        """Whether `text` comes to be on a row (or, for an escape sequence, in the raw
        output) within `timeout` seconds, counting what was shown before the call."""
        end = time.monotonic() + timeout
        while True:
            if "\x1b" in text:
                if text.encode() in self.data:
                    return True
            elif any(_squash(text) in line for line in self.seen):
                return True
            if time.monotonic() >= end:
                return False
            self.pump(0.2)

    def send(self, b: bytes) -> None:
        os.write(self.fd, b)


def signalled_args():
    """The framework stop-signal scripts' arguments (hf_signalled.py,
    lightning_signalled.py): where they write, a sleep per micro-batch so a signal lands
    inside a step, or a checkpoint to resume from."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def sigterm_inside_a_step(script: str, out: Path, log: Path, forward: int, pattern: str) -> tuple:
    """Runs a framework stop-signal script with 0.3 s micro-batches, sends SIGTERM as
    its `forward`-th micro-batch (counted from the line each prints) begins, one that is
    not its step's last, and checks what every framework's stop inside a step leaves:
    exit 143, the step abandoned at the next micro-batch, one checkpoint (`pattern` in
    `out`) told to the log, the log finished as stopped. Returns the log's records and
    that checkpoint's path. (Not timed from the log: its writer may flush a step's
    record after the next step has begun.)"""
    import signal

    here = Path(__file__).resolve().parent
    p = spawn([str(here / script), "--out", str(out), "--log", str(log), "--sleep", "0.3"])
    seen = 0
    while seen < forward:
        line = p.stdout.readline()
        assert line, f"the script ended after {seen} micro-batches: {p.communicate()[1]}"
        seen += line.strip() == "forward"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    recs = records(log)
    notices = [r["text"] for r in recs if r["kind"] == "notice"]
    assert any("abandoned after" in n for n in notices), notices
    saved = sorted(out.glob(pattern))
    assert len(saved) == 1, saved
    told = [r["path"] for r in recs if r["kind"] == "checkpoint_saved"]
    assert told == [str(saved[0])], told
    assert recs[-1]["kind"] == "finished" and recs[-1]["stopped_by_user"], recs[-2:]
    return recs, saved[0]


def resume_from(script: str, out: Path, log: Path, checkpoint: Path) -> None:
    """The same script, fast, taken up from `checkpoint` to its end."""
    script = str(Path(__file__).resolve().parent / script)
    p = spawn([script, "--out", str(out), "--log", str(log), "--resume", str(checkpoint)])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
