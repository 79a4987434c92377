"""`glimmer chat` driven in a real terminal: tmux send-keys / capture-pane on a tiny model with a tokenizer, a DFlash
drafter and an MTP layer (random weights: the text is noise, but greedy output must not depend on the mode)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import glimmer_mlx

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


class Tmux:
    """One chat process in a private tmux server (its own socket: a clean environment, no user config)."""

    def __init__(self, cmd: str, name: str, width: int = 220):
        self.sock = f"glimmer-test-{name}-{time.time_ns()}"
        self.t = ["tmux", "-L", self.sock, "-f", "/dev/null"]
        subprocess.run(self.t + ["new-session", "-d", "-s", "chat", "-x", str(width), "-y", "60",
                                 f"{cmd}; echo EXITED $?; sleep 120"], check=True)

    def send(self, *keys: str) -> None:
        subprocess.run(self.t + ["send-keys", "-t", "chat", *keys], check=True)

    def line(self, text: str) -> None:
        self.send("-l", text)
        self.send("Enter")

    def screen(self) -> str:
        return subprocess.run(self.t + ["capture-pane", "-p", "-J", "-S", "-500", "-t", "chat"], check=True,
                              capture_output=True, text=True).stdout

    def wait(self, pattern: str, timeout: float = 90, count: int = 1) -> str:
        t0 = time.time()
        while time.time() - t0 < timeout:
            s = self.screen()
            if len(re.findall(pattern, s)) >= count:
                return s
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {pattern!r} (x{count}); screen:\n{self.screen()}")

    def idle(self, prompt: str = "you ›", timeout: float = 90, quiet: float = 1.0) -> str:
        """Wait until the screen ends with the input prompt and stays unchanged for `quiet` seconds: the app is
        waiting for input, so the next keys reach the prompt (not the output still being drawn)."""
        t0, last, since = time.time(), None, time.time()
        while time.time() - t0 < timeout:
            s = self.screen().rstrip()
            if s != last:
                last, since = s, time.time()
            elif s.endswith(prompt) and time.time() - since >= quiet:
                return s
            time.sleep(0.1)
        raise AssertionError(f"the prompt did not come back within {timeout} s; screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(self.t + ["kill-server"], capture_output=True)


@pytest.fixture(scope="module")
def chat_model(tiny_checkpoint, tmp_path_factory):
    from hf_fixtures import build_hf_drafter, build_hf_mtp, save_mtp_weights

    path, hf = tiny_checkpoint(seed=31, tokenizer=True, num_mtp_layers=1, mtp_layer_types=["sliding_attention"])
    save_mtp_weights(build_hf_mtp(hf, 1, seed=3), path)
    d = tmp_path_factory.mktemp("chat_drafter")
    build_hf_drafter().save_pretrained(d)
    return path, d


def chat_cmd(path, *args) -> str:
    cache = Path(str(path)).parent / "calibration"  # auto's calibration cache: next to the tmp checkpoint
    return " ".join([f"GLIMMER_MLX_CACHE_DIR={cache}", sys.executable, "-m", "glimmer_mlx.cli", "chat", "--model",
                     str(path), *map(str, args)])


STATS = r"(\d+) tok · [\d.]+ tok/s · .*?prompt (\d+) new \+ (\d+) cached tok"


def test_chat_session_in_a_terminal(chat_model, tmp_path):
    """Streaming turns with a stats line (τ and speedup in speculative modes, prompt tokens reused from the cache),
    multi-line input, /mode, /clear, /save, /load, /temp, /stats, /help, errors that keep the chat going, the
    context guard, and Ctrl-D."""
    path, drafter = chat_model
    # the checkpoint's own MTP layers load without asking
    tm = Tmux(chat_cmd(path, "--draft-model", drafter, "-m", 12, "--max-context", 160), "main")
    try:
        tm.wait(r"you ›")
        s = tm.screen()
        assert "mode auto" in s and "modes available: ar, dflash, mtp, ngram, auto" in s  # the default with drafters
        tm.line("Hello there")
        s = tm.wait(STATS)
        n, new, cached = map(int, re.findall(STATS, s)[-1])
        assert cached == 0 and new > 0 and n <= 12
        assert re.search(r"τ [\d.]+ · ×[\d.]+ vs plain [\d.]+ tok/s \(calibration \(32 greedy tokens\)\) · auto", s)
        # a second turn reuses the cache: the whole first prompt is cached, but for the few positions MTP restarts
        # its chain from when it was in step at the end of the turn (auto keeps it in step while it could pay)
        tm.send("-l", "line one \\")
        tm.send("Enter")
        tm.wait(r"  … ")
        tm.line("line two")
        s = tm.wait(STATS, count=2)
        _, new2, cached2 = map(int, re.findall(STATS, s)[-1])
        assert cached2 >= new - 6, s
        tm.line(f"/save {tmp_path / 'a.json'}")
        tm.wait(r"saved 4 messages to .*a\.json")
        saved = json.loads((tmp_path / "a.json").read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
        assert saved["messages"][2]["content"] == "line one \nline two"
        # the same conversation in ar and mtp gives the same answers (lossless speculative decoding)
        for mode in ("ar", "mtp"):
            tm.line(f"/mode {mode}")
            tm.wait(rf"\nmode {mode}\n")
            tm.line("/clear")
            tm.wait(r"new conversation", count=1 if mode == "ar" else 2)
            tm.line("Hello there")
            tm.send("-l", "line one \\")
            tm.send("Enter")
            tm.line("line two")
            tm.wait(STATS, count=4 if mode == "ar" else 6)
            tm.line(f"/save {tmp_path / (mode + '.json')}")
            tm.wait(rf"saved 4 messages to .*{mode}\.json")
            other = json.loads((tmp_path / f"{mode}.json").read_text())
            assert other["messages"] == saved["messages"], mode
        s = tm.screen()
        assert re.search(r"\d+ tok · [\d.]+ tok/s · ar · prompt", s)  # ar turns: no τ
        assert re.search(r"τ [\d.]+ · ×[\d.]+ vs plain [\d.]+ tok/s \(latest ar turn\) · mtp", s)
        # commands and their errors
        tm.line("/mode warp")
        tm.wait(r"usage: /mode ar\|dflash\|mtp\|ngram\|auto")
        tm.line("/mode dflash 9")
        tm.wait(r"block_size must be in \[2, 4\]")
        tm.line("/temp -1")
        tm.wait(r"'temperature' must be a finite number >= 0")
        tm.line("/temp 0")
        tm.wait(r"temperature 0.0 \(greedy\)")
        tm.line("/image /nonexistent.png")
        tm.wait(r"error: .*nonexistent")
        tm.line("/frobnicate")
        tm.wait(r"unknown command /frobnicate")
        tm.line("/help")
        tm.wait(r"/save FILE")
        tm.line("/stats")
        tm.wait(r"plain rate .* tok/s")
        tm.line(f"/load {tmp_path / 'a.json'}")
        tm.wait(r"loaded 4 messages")
        tm.line("/load /nonexistent.json")
        tm.wait(r"cannot read /nonexistent.json")
        # the context guard: a message that does not fit
        tm.line("the quick brown fox " * 40)
        tm.wait(r"error: context full: the prompt is \d+ tokens and the maximum context length is 160")
        tm.line("/stats")
        tm.wait(r"4 messages", count=1)
        tm.idle()  # the stats are drawn and the prompt is back: Ctrl-D now reaches the prompt
        tm.send("C-d")
        s = tm.wait(r"EXITED \d+")
        assert "bye" in s and "EXITED 0" in s and "Traceback" not in s
    finally:
        tm.close()


def test_ctrl_c_stops_an_answer_and_keeps_the_conversation(chat_model, tmp_path):
    """Ctrl-C during a long answer returns to the prompt with the partial answer kept; the next turn reuses the
    cache; Ctrl-C at the prompt ends the chat cleanly."""
    path, _ = chat_model
    model, tok = glimmer_mlx.load(path)
    for prompt in ("Tell me a story", "Hello there", "def add(a, b):", "import os", "The quick brown fox"):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        if glimmer_mlx.generate(model, ids, tokenizer=tok, max_tokens=200).finish_reason == "length":
            break  # an answer long enough to interrupt
    else:
        pytest.skip("no prompt with a 200-token answer on this tiny model")
    tm = Tmux(chat_cmd(path, "-m", 3000), "ctrlc")
    try:
        tm.wait(r"you ›")
        tm.line(prompt)
        t0 = time.time()
        while len(tm.screen().split(prompt, 1)[1].strip()) < 20 and time.time() - t0 < 60:
            time.sleep(0.1)
        tm.send("C-c")
        tm.wait(r"\[stopped; the partial answer is kept\]")
        s = tm.wait(r"stopped; the partial answer is kept\][\s\S]*" + STATS)  # the stats line may render a frame later
        n, new, cached = map(int, re.findall(STATS, s)[-1])
        assert 0 < n < 200
        tm.wait(r"(?m)^you › $")
        tm.line(f"/save {tmp_path / 'c.json'}")
        tm.wait(r"saved 2 messages to .*c\.json")
        msgs = json.loads((tmp_path / "c.json").read_text())["messages"]
        assert msgs[0]["content"] == prompt and msgs[1]["role"] == "assistant" and msgs[1]["content"]
        tm.line("/stats")
        tm.wait(r"totals\s+1 turns")
        tm.wait(r"(?m)^you › $")  # the prompt is back (a Ctrl-C sent while /stats still renders is not at it)
        tm.send("C-c")  # at the prompt: leave
        s = tm.wait(r"EXITED \d+")
        assert "bye" in s and "EXITED 0" in s and "Traceback" not in s
    finally:
        tm.close()


def limited_chat_cmd(path, max_file_bytes: int, *args) -> str:
    """chat_cmd with every file the chat writes limited to `max_file_bytes` (RLIMIT_FSIZE: a write past it fails
    with EFBIG, as on a full disk; Python ignores SIGXFSZ)."""
    import shlex

    boot = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); "
            "os.execv(sys.executable, [sys.executable, '-m', 'glimmer_mlx.cli', *sys.argv[2:]])")
    cache = Path(str(path)).parent / "calibration"
    return " ".join([f"GLIMMER_MLX_CACHE_DIR={cache}", sys.executable, "-c", shlex.quote(boot), str(max_file_bytes),
                     "chat", "--model", str(path), *map(shlex.quote, map(str, args))])


def test_save_asks_before_replacing_and_never_leaves_half_a_file(chat_model, tmp_path):
    """/save onto an existing file asks first (anything but y keeps it), a folder is refused, and a save that fails
    half-way (here: a file-size limit, as a full disk) leaves the earlier file whole: the old /save overwrote
    without asking and left 4 KB of invalid JSON."""
    path, _ = chat_model
    system = "You are terse. " * 600  # ~8 KB of system prompt: every save is larger than the 6 KB limit below
    tm = Tmux(limited_chat_cmd(path, 6000, "--mode", "ar", "--no-calibrate", "--system-prompt", system), "save")
    try:
        tm.wait(r"you ›")
        old = tmp_path / "old.json"
        old.write_text(json.dumps({"format": "glimmer-chat", "version": 1, "messages": [{"role": "user",
                                                                                         "content": "earlier"}]}))
        before = old.read_text()
        tm.line(f"/save {old}")
        tm.wait(r"old\.json exists; replace it\? \[y/N\]")
        tm.line("n")
        tm.wait(r"not saved \(.*old\.json is unchanged\)")
        assert old.read_text() == before
        tm.line(f"/save {old}")
        tm.wait(r"old\.json exists; replace it\? \[y/N\]", count=2)
        tm.line("y")
        s = tm.wait(r"error: cannot write .*old\.json: File too large; nothing was saved \(the existing file is "
                    r"unchanged\)")
        assert old.read_text() == before and json.loads(old.read_text())["messages"][0]["content"] == "earlier"
        assert not [p.name for p in tmp_path.iterdir() if p.name != "old.json"]  # no temporary file left behind
        tm.line(f"/save {tmp_path}")
        tm.wait(r"error: cannot write .*: it is a folder; give a file name")
        tm.idle()
        tm.send("C-d")
        s = tm.wait(r"EXITED \d+")
        assert "EXITED 0" in s and "Traceback" not in s
    finally:
        tm.close()
    # without the limit: yes replaces the file, atomically, with the whole conversation
    tm = Tmux(chat_cmd(path, "--mode", "ar", "--no-calibrate", "--system-prompt", "'be brief'"), "save2")
    try:
        tm.wait(r"you ›")
        tm.line(f"/save {old}")
        tm.wait(r"old\.json exists; replace it\? \[y/N\]")
        tm.line("yes")
        tm.wait(r"saved 1 messages to .*old\.json")
        saved = json.loads(old.read_text())
        assert saved["messages"] == [{"role": "system", "content": "be brief"}] and saved["system_prompt"] == "be brief"
        tm.line(f"/save {old}")
        tm.wait(r"old\.json exists; replace it\? \[y/N\]")
        tm.send("C-d")  # Ctrl-D at the question: no, and the chat goes on
        tm.wait(r"not saved")
        tm.idle()
        tm.line("/exit")
        s = tm.wait(r"EXITED \d+")
        assert "EXITED 0" in s and "Traceback" not in s
    finally:
        tm.close()
