"""Reward server benchmark: podagent's built-in server vs. a Flask + process-pool baseline,
for each scoring profile.

For each profile (--scoring, default both), podagent's server and a baseline server that
scores by the same rule run as real processes on loopback, each on a free port, with the same
number of verifier processes (--workers, default: this machine's CPUs), and get the same
requests in alternation, so machine noise falls on both alike. Run from the repository root:

    python bench/reward.py --quick        # a smoke check: a few requests per batch size
    python bench/reward.py                # the full run (several minutes on 2 cores)
    python bench/reward.py --per-sample-only               # only the per-sample load (below)
    python bench/reward.py --per-sample-only --server-arg=--item-timeout=10   # and a variant

The workload is GRPO-like and generated from --seed: prompts with realistic LaTeX golds
(fractions, radicals, multiples of pi, intervals, points, polynomials, sets, percentages,
integers, decimals), 8 samples per prompt. A sample's final answer is the gold as written, an
equivalent form (0.75 for \\frac{3}{4}, \\sqrt{12} for 2\\sqrt{3}, ...), one of two wrong
answers, or unparseable (no box, words in the box, a truncated box). Every request is new:
verdicts cached by one request help a later one only where a real run would repeat them too
(batch 1 walks through one prompt's 8 samples in 8 requests).

* openrlhf-m: chat-templated queries (chatml) whose responses are `<think>…</think><answer>…
  </answer>` (some not: broken or missing tags), gold answers looked up by the request's
  prompts in a dataset file both servers load, and some samples repeated verbatim (a policy
  repeats itself). The baseline is written the way OpenRLHF-M's own server is: a Flask app
  that finds the response and its format in the handler and sends every item to a
  `concurrent.futures.ProcessPoolExecutor`, where math-verify parses the gold and the whole
  response with that server's settings and compares them (its default timeouts, no caching).
  It is written here from the rule, independently of podagent's code, so the count of items
  whose rewards differ is a cross-check as well.
* boxed: untemplated queries, labels. The baseline is a Flask app whose handler maps every
  item over a process pool; each item is extracted with the same code as the built-in server
  (`verify.extract`, `verify.canonical`) and then parsed and verified by math-verify with its
  default timeouts. No caching.

Latency is one request's round trip (requests are sent one at a time); items/s is items
divided by the sum of that server's latencies. Warm-up requests are not timed.

Per-sample load (openrlhf-m, after the table above or alone with --per-sample-only): upstream
OpenRLHF posts every sample alone as it finishes, hundreds in flight; OpenRLHF-M posts a batch
per trainer node. Each run's client is a process of its own (`bench/_reward_load.py`: its CPU
is measured, and it shares no interpreter lock), on this machine like the servers. The
per-sample client is upstream's own code from a checkout (--openrlhf), else one of its shape:
--samples one-sample requests, --in-flight at once, a new aiohttp session per request. The
ceiling is that client, on the same samples, against a server that answers zeros at once
(`bench/_reward_servers.py zero`); every per-sample rate is given as a fraction of the
ceiling's in the same round. The baseline is OpenRLHF-M's own server from a checkout
(--openrlhf-m, run unmodified but for its address), else the seed-shaped server above;
--before runs an earlier podagent checkout's server too, --server-arg one with other settings.
podagent also gets batches of --batch items from one client and from 8 clients at once
(requests.post, as OpenRLHF-M's). samples/s is samples over the wall time from the first send
to the last reply. Golds are written `$…$` in the dataset, so every item is verified. Every
round's workloads are new (the per-sample one shared by the servers, so their rewards are
compared sample by sample), the order of the runs is reversed every other round; rows show the
first round (the first samples after a warm-up), the worst and the best.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import requests  # noqa: E402
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed  # noqa: E402

from bench._reward_load import Job, Load, run_load  # noqa: E402
from podagent.rewards import openrlhf_m, similar, verify  # noqa: E402
from podagent.rewards.settings import SCORING, cpu_count  # noqa: E402

SAMPLES_PER_PROMPT = 8
BATCHES = (1, 64, 256)
FULL_REQUESTS = {1: 480, 64: 32, 256: 16}
QUICK_REQUESTS = {1: 16, 64: 2, 256: 2}
WARMUP_REQUESTS = 2
START_TIMEOUT = 120.0
REQUEST_TIMEOUT = 180.0  # what OpenRLHF's client allows

# --- the baseline server -----------------------------------------------------------------------


def baseline_item(query: str, prompt: str | None, label: str | None) -> tuple[float, float]:
    """boxed, one item, the common way: extract, then math-verify parse + verify (no caches)."""
    import math_verify

    found = verify.extract(verify.split_response(query, prompt))
    fmt = 1.0 if found.well_formed else 0.0
    gold = verify.canonical_gold(label) if label else None
    if found.answer is None or not gold:
        return 0.0, fmt
    answer = verify.canonical(found.answer)
    parsed_gold = math_verify.parse("\\boxed{" + gold + "}")
    parsed_answer = math_verify.parse("\\boxed{" + answer + "}")
    return (1.0 if math_verify.verify(parsed_gold, parsed_answer) else 0.0), fmt


def seed_accuracy(response: str, gold: str) -> float:
    """openrlhf-m, one item's accuracy as OpenRLHF-M's server computes it (run in the pool)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse
    from math_verify import verify as mv_verify

    gold_parsed = parse(gold, extraction_mode="first_match",
                        extraction_config=[LatexExtractionConfig()])
    if not gold_parsed:
        return 1.0  # that server skips an unparseable gold by scoring it 1
    answer_parsed = parse(response, extraction_mode="first_match", extraction_config=[
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, equations=True,
                boxed=True, units=True),
            boxed_match_priority=0, try_extract_without_anchor=False)])
    try:
        return float(mv_verify(answer_parsed, gold_parsed))
    except Exception:
        return 1.0


def serve_baseline(host: str, port: int, workers: int, scoring: str,
                   dataset: str | None) -> None:
    import logging

    from flask import Flask, jsonify, request

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    executor = ProcessPoolExecutor(max_workers=workers)
    app = Flask("baseline-reward-server")
    golds: dict[str, str] = {}
    for line in Path(dataset).read_text().splitlines() if dataset else ():
        record = json.loads(line)
        answer = record["answer"].strip()
        golds[record["prompt"]] = answer if answer.startswith("$") else f"${answer}$"
    prompts = list(golds)

    @app.post("/get_reward")
    def get_reward():
        data = request.get_json()
        query = data["query"]
        if scoring == "openrlhf-m":
            futures, formats = [], []
            for q, prompt in zip(query, data["prompts"], strict=True):
                if prompt not in golds:
                    prompt = prompts[similar.closest(prompt, prompts)]
                response = openrlhf_m.response_of(q, "chatml")
                formats.append(0.5 if openrlhf_m.well_formed(response) else 0.0)
                futures.append(executor.submit(seed_accuracy, response, golds[prompt]))
            acc = [f.result() for f in futures]
            return jsonify(rewards=[f + a for f, a in zip(formats, acc, strict=True)],
                           format_rewards=formats, acc_rewards=acc)
        prompts_ = data.get("prompts") or [None] * len(query)
        labels = data.get("labels") or [None] * len(query)
        results = list(executor.map(baseline_item, query, prompts_, labels))
        acc = [a for a, _ in results]
        fmt = [f for _, f in results]
        return jsonify(rewards=[a + verify.FORMAT_WEIGHT * f for a, f in results], scores=acc,
                       format_rewards=fmt, acc_rewards=acc)

    @app.get("/health")
    def health():
        return jsonify(status="ok")

    def stop(*_: object) -> None:
        # The pool's processes first: they are idle by now, and would outlive a bare exit.
        executor.shutdown(wait=True, cancel_futures=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    app.run(host=host, port=port, threaded=True)


# --- the workload ------------------------------------------------------------------------------

FILLER = (
    "Let me set up the problem carefully.", "First, I rewrite the expression.",
    "We can simplify the fraction by cancelling common factors.",
    "Substituting back, we obtain $x = 2y + 1$.", "Checking the boundary cases is important.",
    "By the quadratic formula, $x = \\frac{-b \\pm \\sqrt{b^2-4ac}}{2a}$.",
    "So the sum telescopes.", "Hmm, wait, let me double-check that step.",
    "This gives $\\left(\\frac{a}{b}\\right)^2 = \\frac{a^2}{b^2}$.",
    "Therefore both conditions hold.", "Now consider the case $n \\geq 3$.",
)
SQUAREFREE = (2, 3, 5, 6, 7, 10, 11, 13)


def _frac(a: int, b: int) -> str:
    return rf"\frac{{{a}}}{{{b}}}"


def _gold(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(gold, equivalent forms, wrong answers) of one prompt."""
    kind = rng.randrange(10)
    if kind == 0:
        n = rng.randint(2, 5000)
        same = [f"{n}.0"] + ([f"{n:,}"] if n >= 1000 else [f"{n} \\text{{ units}}"])
        return str(n), same, [str(n + 1), str(2 * n)]
    if kind == 1:
        b = rng.choice((2, 4, 5, 8, 3, 6, 7, 9, 12))
        a = rng.choice([k for k in range(1, 4 * b) if gcd(k, b) == 1])
        same = [f"{a}/{b}", rf"\dfrac{{{2 * a}}}{{{2 * b}}}"]
        if b in (2, 4, 5, 8):
            same.append(f"{a / b:g}")
        return _frac(a, b), same, [_frac(b, a), _frac(a + 1, b)]
    if kind == 2:
        a, b = rng.randint(2, 9), rng.choice(SQUAREFREE)
        return rf"{a}\sqrt{{{b}}}", [rf"\sqrt{{{a * a * b}}}", rf"{a} \sqrt{{{b}}}"], [
            rf"\sqrt{{{a * b}}}", rf"{a + 1}\sqrt{{{b}}}"]
    if kind == 3:
        b = rng.choice((2, 3, 4, 6, 12))
        a = rng.choice([k for k in range(1, 2 * b) if gcd(k, b) == 1])
        k = "" if a == 1 else str(a)
        return rf"\frac{{{k}\pi}}{{{b}}}", [rf"\frac{{{a}}}{{{b}}}\pi", rf"{k}\pi/{b}"], [
            rf"\frac{{{b}\pi}}{{{a}}}", _frac(a, b)]
    if kind == 4:
        a = rng.randint(-9, 5)
        b = a + rng.randint(1, 9)
        return f"[{a}, {b})", [f"[{a},{b})", rf"\left[{a}, {b}\right)"], [
            f"[{a}, {b}]", f"({a}, {b})"]
    if kind == 5:
        a, b = rng.randint(-9, 9), rng.randint(1, 9)
        return f"({a}, {b})", [rf"\left({a}, {b}\right)", f"({a},{b})"], [
            f"({b}, {a})", f"({a}, {-b})"]
    if kind == 6:
        r, s = rng.randint(1, 9), rng.randint(1, 9)
        p, q = r + s, r * s
        return f"x^2 + {p}x + {q}", [f"{q} + {p}x + x^2", f"(x+{r})(x+{s})"], [
            f"x^2 + {p}x - {q}", f"x^2 + {q}x + {p}"]
    if kind == 7:
        a, b, c = rng.sample(range(-9, 20), 3)
        return rf"\{{{a}, {b}, {c}\}}", [rf"\{{{c}, {a}, {b}\}}", rf"\{{{b},{c},{a}\}}"], [
            rf"\{{{a}, {b}\}}", rf"\{{{a}, {b}, {c + 1}\}}"]
    if kind == 8:
        p = rng.choice((5, 10, 12.5, 20, 25, 40, 60, 75))
        return rf"{p:g}\%", [f"{p:g}", f"{p / 100:g}"], [rf"{p + 5:g}\%", f"{p / 10:g}"]
    num, den = rng.randint(1, 99), rng.choice((4, 8, 20))
    value = -num / den
    return f"{value:g}", [_frac(-num, den) if gcd(num, den) == 1 else f"{value:.6f}"], [
        f"{-value:g}", f"{value - 1:g}"]


UNPARSEABLE = ("I think the answer is around {g}.", r"\boxed{I am not sure}",
               r"so the answer is \boxed{\frac{3", "<answer></answer>")


def _response(rng: random.Random, prompt: str, answer_text: str) -> str:
    words: list[str] = []
    length = rng.randint(400, 3000)
    while sum(len(w) + 1 for w in words) < length:
        words.append(rng.choice(FILLER))
    return f"{prompt} {' '.join(words)} {answer_text}"


def _prompt_samples(rng: random.Random, index: int) -> list[tuple[str, str, str]]:
    """(query, prompt, label) for one prompt's 8 samples."""
    gold, same, wrong = _gold(rng)
    prompt = (f"<|user|>Problem {index}: solve it and put your final answer within "
              f"\\boxed{{}}.<|assistant|>")
    samples = []
    for _ in range(SAMPLES_PER_PROMPT):
        roll = rng.random()
        if roll < 0.40:
            tail = rf"Therefore, the final answer is $\boxed{{{gold}}}$."
        elif roll < 0.55:
            tail = rf"Therefore, the final answer is $\boxed{{{rng.choice(same)}}}$."
        elif roll < 0.85:
            tail = rf"Therefore, the final answer is $\boxed{{{rng.choice(wrong)}}}$."
        else:
            tail = rng.choice(UNPARSEABLE).replace("{g}", "12")
        samples.append((_response(rng, prompt, tail), prompt, gold))
    return samples


def workload(seed: int, batch: int, count: int) -> list[dict[str, list[str]]]:
    """boxed: `count` requests of `batch` items; prompts never repeat across requests."""
    rng = random.Random(seed * 1000 + batch)
    items: list[tuple[str, str, str]] = []
    index = 0
    while len(items) < batch * count:
        items.extend(_prompt_samples(rng, index))
        index += 1
    payloads = []
    for start in range(0, batch * count, batch):
        chunk = items[start : start + batch]
        payloads.append({"query": [q for q, _, _ in chunk], "prompts": [p for _, p, _ in chunk],
                         "labels": [g for _, _, g in chunk]})
    return payloads


CHATML = ("<|im_start|>system\nYou are a helpful assistant. Think in <think> </think>, then "
          "answer in <answer> </answer>.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
          "<|im_start|>assistant\n{response}<|im_end|>")
BROKEN = ("<think>{t}</think> I think the answer is around 12.",  # no answer block
          "<think>{t}</think><answer>\\boxed{{I am not sure}}</answer>",
          "<think>{t}</think><answer>so the answer is \\boxed{{\\frac{{3}}{{4</answer>",
          "<think>{t}</think><answer></answer>", "<think>{t}<answer>$12$</answer>",
          "{t} The answer is $12$.")


def _think(rng: random.Random) -> str:
    words: list[str] = []
    length = rng.randint(400, 3000)
    while sum(len(w) + 1 for w in words) < length:
        words.append(rng.choice(FILLER))
    return " ".join(words)


def seed_prompt(seed: int, batch: int, index: int) -> str:
    return f"[{seed}/{batch}] Problem {index}: solve it; answer in LaTeX."


def _seed_samples(rng: random.Random, prompt: str, gold: str, same: list[str],
                  wrong: list[str]) -> list[str]:
    """One prompt's 8 templated queries for openrlhf-m."""
    samples: list[str] = []
    for _ in range(SAMPLES_PER_PROMPT):
        roll = rng.random()
        if samples and roll < 0.15:  # the policy repeats an earlier sample verbatim
            samples.append(rng.choice(samples))
            continue
        t = _think(rng)
        shape = rng.random()
        if roll < 0.45:
            answer = gold
        elif roll < 0.6:
            answer = rng.choice(same)
        elif roll < 0.85:
            answer = rng.choice(wrong)
        else:
            response = rng.choice(BROKEN).format(t=t)
            samples.append(CHATML.format(prompt=prompt, response=response))
            continue
        if shape < 0.6:
            tail = rf"The final answer is $\boxed{{{answer}}}$."
        elif shape < 0.9:
            tail = f"${answer}$"
        else:
            tail = rf"\[{answer}\]"
        response = f"<think>{t}</think><answer>{tail}</answer>"
        samples.append(CHATML.format(prompt=prompt, response=response))
    return samples


def seed_workload(seed: int, batch: int, count: int) -> tuple[list[dict[str, list[str]]],
                                                              list[dict[str, str]]]:
    """openrlhf-m: `count` requests of `batch` items, and the dataset records they need."""
    rng = random.Random(seed * 1000 + batch + 17)
    items: list[tuple[str, str]] = []
    records = []
    index = 0
    while len(items) < batch * count:
        gold, same, wrong = _gold(rng)
        prompt = seed_prompt(seed, batch, index)
        records.append({"prompt": prompt, "answer": gold})
        items.extend((q, prompt) for q in _seed_samples(rng, prompt, gold, same, wrong))
        index += 1
    payloads = []
    for start in range(0, batch * count, batch):
        chunk = items[start : start + batch]
        payloads.append({"query": [q for q, _ in chunk], "prompts": [p for _, p in chunk]})
    return payloads, records


# --- running -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    session: requests.Session = field(default_factory=requests.Session)
    latencies: dict[int, list[float]] = field(default_factory=dict)

    def post(self, payload: dict[str, Any]) -> dict[str, list[float]]:
        reply = self.session.post(f"{self.url}/get_reward", json=payload, timeout=REQUEST_TIMEOUT)
        reply.raise_for_status()
        return reply.json()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; then whatever of its session is left (a server
        that does not stop its pool on SIGTERM, as the seed's, leaves its workers) is killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


def start(name: str, argv: list[str], port: int, log: Path,
          probe: dict[str, list[str]], cwd: Path = REPO) -> Server:
    """The server, once it answers `probe` (one item of the workload) with one reward. `cwd`:
    where `python -m podagent...` finds the package (another checkout: another version)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    server = Server(name, proc, f"http://127.0.0.1:{port}")

    def ready() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}")
        assert len(server.post(probe)["rewards"]) == 1

    for attempt in Retrying(stop=stop_after_delay(START_TIMEOUT), wait=wait_fixed(0.2),
                            retry=retry_if_exception_type(requests.RequestException),
                            reraise=True):
        with attempt:
            ready()
    return server


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def table(profile: str, servers: list[Server], batches: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        base = next(s for s in servers if s.name == "baseline")
        base_lat = base.latencies[batch]
        base_rate = batch * len(base_lat) / sum(base_lat)
        base_p99 = percentile(base_lat, 99)
        for server in servers:
            lat = server.latencies[batch]
            rate = batch * len(lat) / sum(lat)
            rows.append({"profile": profile, "batch": batch, "server": server.name,
                         "requests": len(lat), "items_per_s": rate,
                         "p50_ms": 1000 * statistics.median(lat),
                         "p99_ms": 1000 * percentile(lat, 99), "ratio": rate / base_rate,
                         "p99_ratio": percentile(lat, 99) / base_p99})
    return rows


def render(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ("profile", "batch", "server", "requests", "items/s", "p50 ms", "p99 ms",
            "throughput vs baseline", "p99 vs baseline")
    lines = []
    for r in rows:
        lines.append((r["profile"], str(r["batch"]), r["server"], str(r["requests"]),
                      f"{r['items_per_s']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['ratio']:.2f}x", f"{r['p99_ratio']:.2f}x"))
    return _layout(head, lines, markdown)


def _layout(head: tuple[str, ...], lines: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines])


@dataclass
class Profile:
    """One profile's run: its servers' latencies and what the built-in server counted."""

    name: str
    servers: list[Server]
    disagreements: int = 0
    items: int = 0
    counters: dict[str, Any] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)


def _payloads(profile: str, seed: int, batch: int, count: int,
              dataset: list[dict[str, str]]) -> list[dict[str, list[str]]]:
    if profile == "boxed":
        return workload(seed, batch, count)
    payloads, records = seed_workload(seed, batch, count)
    dataset.extend(records)
    return payloads


def run_profile(profile: str, args: argparse.Namespace, counts: dict[int, int],
                out: Path) -> Profile:
    # Every request is generated before the servers start: openrlhf-m's dataset must hold all
    # of their prompts.
    records: list[dict[str, str]] = []
    plan = {batch: (_payloads(profile, args.seed + 7919, batch, WARMUP_REQUESTS, records),
                    _payloads(profile, args.seed, batch, counts[batch], records))
            for batch in BATCHES}
    extra: list[str] = []
    if profile == "openrlhf-m":
        dataset = out / "openrlhf-m-dataset.jsonl"
        dataset.write_text("".join(json.dumps(r) + "\n" for r in records))
        extra = ["--dataset", str(dataset)]
    first = plan[BATCHES[0]][0][0]
    probe = {k: v[:1] for k, v in first.items()}
    result = Profile(profile, [])
    try:
        port = free_port()
        result.servers.append(start("podagent", [
            sys.executable, "-m", "podagent.rewards", "--scoring", profile, "--port", str(port),
            "--workers", str(args.workers), *extra], port, out / f"{profile}-podagent.log", probe))
        port = free_port()
        result.servers.append(start("baseline", [
            sys.executable, str(Path(__file__).resolve()), "--serve-baseline",
            "--scoring", profile, "--port", str(port), "--workers", str(args.workers), *extra],
            port, out / f"{profile}-baseline.log", probe))
        for batch, (warm, timed) in plan.items():
            for server in result.servers:
                for payload in warm:
                    server.post(payload)
                server.latencies[batch] = []
            for number, payload in enumerate(timed):
                # Alternate which server goes first, so neither always follows the other.
                servers = result.servers
                order = servers if number % 2 == 0 else servers[::-1]
                replies = {}
                for server in order:
                    started = time.perf_counter()
                    replies[server.name] = server.post(payload)
                    server.latencies[batch].append(time.perf_counter() - started)
                ours, theirs = replies["podagent"]["rewards"], replies["baseline"]["rewards"]
                assert len(ours) == len(theirs) == batch
                result.disagreements += sum(a != b for a, b in zip(ours, theirs, strict=True))
                result.items += batch
            done = {s.name: sum(s.latencies[batch]) for s in result.servers}
            print(f"{profile} batch {batch}: {counts[batch]} requests; busy s " +
                  ", ".join(f"{k} {v:.1f}" for k, v in done.items()), flush=True)
        ours = result.servers[0]
        health = ours.session.get(f"{ours.url}/health", timeout=10).json()
        result.counters = {k: health[k] for k in (
            "items", "fast_path", "cache_hits", "deduped", "verified", "timeouts",
            "gold_parses", "quirks")}
    finally:
        result.exit_codes = {s.name: s.stop() for s in result.servers}
    return result


# --- per-sample load: one sample per request, many in flight -----------------------------------

PER_SAMPLE = 2048  # samples per run (quick: QUICK_PER_SAMPLE)
QUICK_PER_SAMPLE = 128
IN_FLIGHT = 512
BATCH = 256  # the batched rows' request size (quick: QUICK_BATCH)
QUICK_BATCH = 16
CLIENTS = 8  # trainer nodes posting batches at once
ROUNDS = 4  # even: each order of the runs comes up as often
WARMUP_SAMPLES = 256  # and one batch: the verdict and parse caches warm before round 0
PER_SAMPLE_MODES = ("per-sample", "batched-1", f"batched-{CLIENTS}")
# The per-sample goals this bench checks (issue: the server at the client's own ceiling).
GOAL_OF_CEILING = 0.9  # every round, the first included
GOAL_P99_MS = 500.0
GOAL_VS_SEED = 6.0
CEILING, BASELINE, BEFORE = "ceiling", "baseline", "podagent-before"


@dataclass(frozen=True)
class Step:
    """One timed run: `server` gets `payloads` in `mode` (its client shape)."""

    mode: str
    server: str
    round: int
    payloads: list[dict[str, list[str]]]

    def job(self, url: str, args: argparse.Namespace) -> Job:
        if self.mode == "per-sample":
            return Job("per-sample", url, self.payloads, in_flight=args.in_flight,
                       clients=args.sample_clients, upstream=args.openrlhf)
        return Job("batched", url, self.payloads, clients=int(self.mode.split("-")[1]))


def _in_dollars(records: list[dict[str, str]]) -> list[dict[str, str]]:
    # Golds written as `$…$`, as datasets write them: each one parses, so no item is scored
    # without being verified.
    return [{**r, "answer": f"${r['answer']}$"} for r in records]


def _samples(seed: int, count: int, records: list[dict[str, str]]) -> list[dict[str, list[str]]]:
    """`count` one-sample requests as upstream OpenRLHF sends them (query, prompts, labels)."""
    payloads, new = seed_workload(seed, 1, count)
    new = _in_dollars(new)
    records.extend(new)
    golds = {r["prompt"]: r["answer"] for r in new}
    return [{**p, "labels": [golds[p["prompts"][0]]]} for p in payloads]


def _batches(seed: int, batch: int, count: int,
             records: list[dict[str, str]]) -> list[dict[str, list[str]]]:
    payloads, new = seed_workload(seed, batch, count)
    records.extend(_in_dollars(new))
    return payloads


def per_sample_plan(args: argparse.Namespace, podagents: list[str],
                    records: list[dict[str, str]]) -> list[Step]:
    """Every round's runs, each round's workloads new (no server has seen them); the order is
    reversed every other round so the machine's noise falls on every row alike. The ceiling
    (the client against a server that does no work) runs in every round, on the same samples
    as the servers."""
    samples, batch = args.samples, args.batch
    batched_8 = max(samples, CLIENTS * batch) // batch  # at least one batch per client
    steps = []
    for number in range(args.rounds):
        seed = args.seed * 100 + 10 * number
        shared = _samples(seed, samples, records)  # the same samples for every server
        order = [Step("per-sample", s, number, shared) for s in (CEILING, *podagents, BASELINE)]
        if not args.no_batched:
            one = _batches(seed + 1, batch, -(-samples // batch), records)
            eight = _batches(seed + 2, batch, batched_8, records)
            for name in podagents:
                order += [Step("batched-1", name, number, one),
                          Step(PER_SAMPLE_MODES[2], name, number, eight)]
        steps += order if number % 2 == 0 else order[::-1]
    return steps


@dataclass(frozen=True)
class Row:
    mode: str
    server: str
    loads: list[Load]  # one per round, in round order

    @property
    def best(self) -> Load:
        return max(self.loads, key=lambda load: load.samples / load.wall_s)

    def rate(self, load: Load | None = None) -> float:
        load = load or self.best
        return load.samples / load.wall_s

    def rates(self) -> list[float]:
        return [self.rate(load) for load in self.loads]


def of_ceiling(row: Row, ceiling: Row | None) -> list[float] | None:
    """Each round's rate as a fraction of the ceiling's in the same round."""
    if ceiling is None or row.mode != "per-sample":
        return None
    return [row.rate(a) / ceiling.rate(b) for a, b in zip(row.loads, ceiling.loads, strict=True)]


def load_row(row: Row, label: str, cpus: int, ceiling: Row | None) -> dict[str, Any]:
    rates, fractions = row.rates(), of_ceiling(row, ceiling)
    p99s = [1000 * percentile(load.latencies, 99) for load in row.loads]
    middle = sorted(row.loads, key=lambda load: load.server_cpu_s / load.samples)[
        len(row.loads) // 2]
    return {"mode": row.mode, "server": label, "samples": row.loads[0].samples,
            "requests": len(row.loads[0].latencies), "samples_per_s": row.rate(),
            "first_samples_per_s": rates[0], "worst_samples_per_s": min(rates),
            "rounds_samples_per_s": rates,
            "of_ceiling_first": fractions[0] if fractions else None,
            "of_ceiling_worst": min(fractions) if fractions else None,
            "rounds_of_ceiling": fractions,
            "p50_ms": 1000 * statistics.median(t for load in row.loads for t in load.latencies),
            "p99_ms_worst": max(p99s), "rounds_p99_ms": p99s,
            "client_cpu_share": row.best.client_cpu_s / (row.best.wall_s * cpus),
            "server_cpu_ms_per_sample": 1000 * middle.server_cpu_s / middle.samples,
            "retries": sum(load.retries for load in row.loads),
            "failures": sum(load.failures for load in row.loads)}


def _fraction(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def render_load(rows: list[dict[str, Any]], markdown: bool) -> str:
    head = ("mode", "server", "samples", "samples/s first", "worst", "best",
            "of ceiling first", "of ceiling worst", "p50 ms", "p99 ms (worst round)",
            "client CPU share", "server CPU ms/sample", "failures")
    lines = [(r["mode"], r["server"], f"{r['samples']:,}", f"{r['first_samples_per_s']:,.0f}",
              f"{r['worst_samples_per_s']:,.0f}", f"{r['samples_per_s']:,.0f}",
              _fraction(r["of_ceiling_first"]), _fraction(r["of_ceiling_worst"]),
              f"{r['p50_ms']:,.0f}", f"{r['p99_ms_worst']:,.0f}",
              f"{100 * r['client_cpu_share']:.0f} %",
              "" if r["server"].startswith(CEILING) else f"{r['server_cpu_ms_per_sample']:.2f}",
              str(r["failures"])) for r in rows]
    return _layout(head, lines, markdown)


def differences(a: Load, b: Load) -> int:
    """Requests whose rewards differ (a failed request counts as a difference)."""
    return sum(x is None or x != y for x, y in zip(a.rewards, b.rewards, strict=True))


def _rounds(values: list[float], unit: str = "x") -> str:
    return ", ".join(f"{v:.2f}{unit}" for v in values)


def goal_notes(rows: dict[tuple[str, str], Row], podagents: list[str],
               labels: dict[str, str], args: argparse.Namespace) -> list[str]:
    """Each podagent server against the goals, every round counted."""
    notes = []
    ceiling, base = rows.get(("per-sample", CEILING)), rows["per-sample", BASELINE]
    for name in podagents:
        ours = rows["per-sample", name]
        fractions = of_ceiling(ours, ceiling) or []
        p99 = max(percentile(load.latencies, 99) for load in ours.loads) * 1000
        vs_seed = [ours.rate(a) / base.rate(b) for a, b in zip(ours.loads, base.loads,
                                                                strict=True)]
        notes.append(
            f"- {labels[name]}: of the ceiling, rounds in order **{_rounds(fractions, '')}** "
            f"(goal ≥ {GOAL_OF_CEILING} in every round: "
            f"{'met' if fractions and min(fractions) >= GOAL_OF_CEILING else 'NOT met'}); "
            f"p99 of the worst round **{p99:,.0f} ms** (goal < {GOAL_P99_MS:.0f} ms: "
            f"{'met' if p99 < GOAL_P99_MS else 'NOT met'}); per-sample / {labels[BASELINE]} "
            f"per-sample **{statistics.median(vs_seed):.2f}x** median (rounds: "
            f"{_rounds(vs_seed)}; goal ≥ {GOAL_VS_SEED:g}x, on 2 cores).")
        if not args.no_batched:
            batched = rows[PER_SAMPLE_MODES[2], name]
            notes.append(f"- {labels[name]} per-sample / its batched ({args.batch} per "
                         f"request) from {CLIENTS} clients: "
                         f"**{ours.rate() / batched.rate():.2f}x** (best rounds).")
    for name in podagents[1:]:
        ratios = []
        for mode in PER_SAMPLE_MODES if not args.no_batched else PER_SAMPLE_MODES[:1]:
            a, b = rows[mode, "podagent"], rows[mode, name]
            ratios.append(f"{mode} **{a.rate() / b.rate():.2f}x** (rounds: " + ", ".join(
                f"{a.rate(x) / b.rate(y):.2f}x" for x, y in zip(a.loads, b.loads, strict=True))
                + ")")
        notes.append(f"- podagent / {labels[name]}: {'; '.join(ratios)}.")
    return notes


def reward_checks(rows: dict[tuple[str, str], Row], podagents: list[str],
                  labels: dict[str, str], args: argparse.Namespace) -> list[str]:
    """Rewards that differ, sample by sample: each podagent vs the baseline (per-sample), and
    the variant vs podagent (every mode)."""
    base = rows["per-sample", BASELINE]
    checks = []
    for name in podagents:
        ours = rows["per-sample", name]
        diff = sum(differences(a, b) for a, b in zip(ours.loads, base.loads, strict=True))
        checks.append(f"- per-sample rewards that differ between {labels[name]} and "
                      f"{labels[BASELINE]}: **{diff}** of {sum(a.samples for a in ours.loads)} "
                      f"samples.")
    for name in podagents[1:]:
        for mode in PER_SAMPLE_MODES if not args.no_batched else PER_SAMPLE_MODES[:1]:
            a, b = rows[mode, "podagent"], rows[mode, name]
            diff = sum(differences(x, y) for x, y in zip(a.loads, b.loads, strict=True))
            checks.append(f"- {mode}: rewards that differ between podagent and "
                          f"{labels[name]}: {diff} requests.")
    return checks


def start_servers(args: argparse.Namespace, podagents: list[str], dataset: Path, out: Path,
                  probe: dict[str, list[str]], servers: dict[str, Server]) -> None:
    """Into `servers`, as each answers (so the caller can stop those that started)."""
    port = free_port()
    servers[CEILING] = start(CEILING, [
        sys.executable, str(REPO / "bench" / "_reward_servers.py"), "zero", "--port",
        str(port)], port, out / "per-sample-zero.log", probe)
    common = ["--scoring", "openrlhf-m", "--workers", str(args.workers), "--dataset",
              str(dataset)]
    for name in podagents:
        port = free_port()
        extra = args.server_arg if name == "podagent-variant" else []
        servers[name] = start(name, [
            sys.executable, "-m", "podagent.rewards", "--port", str(port), *common, *extra],
            port, out / f"per-sample-{name}.log", probe,
            cwd=Path(args.before) if name == BEFORE else REPO)
    port = free_port()
    if args.openrlhf_m:
        # The seed's own server, as written (its pool of 16 processes whatever --workers says).
        argv = [sys.executable, str(REPO / "bench" / "_reward_servers.py"), "seed", "--port",
                str(port), "--source", args.openrlhf_m, "--dataset", str(dataset),
                "--log-file", str(out / "per-sample-seed-loguru.log")]
    else:
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-baseline", "--port",
                str(port), *common]
    servers[BASELINE] = start(BASELINE, argv, port, out / "per-sample-baseline.log", probe)


def run_steps(steps: list[Step], servers: dict[str, Server], args: argparse.Namespace,
              out: Path, labels: dict[str, str]) -> dict[tuple[str, str], Row]:
    rows: dict[tuple[str, str], Row] = {}
    for step in steps:
        server = servers[step.server]
        load = run_load(step.job(f"{server.url}/get_reward", args), server.proc.pid, out,
                        f"{step.mode}-{step.server}-{step.round}")
        row = rows.setdefault((step.mode, step.server), Row(step.mode, step.server, []))
        row.loads.append(load)
        print(f"round {step.round}: {step.mode:>10} {labels[step.server]}: "
              f"{load.samples / load.wall_s:.1f} samples/s, {load.wall_s:.1f} s, "
              f"p99 {1000 * percentile(load.latencies, 99):.0f} ms, "
              f"client CPU {load.client_cpu_s:.1f} s, server CPU {load.server_cpu_s:.1f} s"
              f"{f', {load.failures} FAILED' if load.failures else ''}", flush=True)
    return rows


def run_per_sample(args: argparse.Namespace, out: Path) -> None:
    """openrlhf-m under per-sample load (upstream OpenRLHF's client) against the ceiling (that
    client against a server that does no work), podagent and the baseline (the seed's own server
    with --openrlhf-m, else one written its way); batched load (OpenRLHF-M's) on podagent."""
    podagents = ["podagent", *(["podagent-variant"] if args.server_arg else []),
                 *([BEFORE] if args.before else [])]
    labels = {CEILING: "ceiling (a server that answers zeros at once)", "podagent": "podagent",
              BEFORE: f"podagent before ({args.before_label or args.before})",
              BASELINE: ("seed (OpenRLHF-M's own server)" if args.openrlhf_m
                         else "baseline (seed-shaped)"),
              "podagent-variant": "podagent " + " ".join(args.server_arg)}
    client = ("upstream OpenRLHF's own client code (SingleTurnAgentExecutor."
              "_fetch_rewards_via_http)" if args.openrlhf
              else "a client of upstream's shape (no --openrlhf checkout given)")
    records: list[dict[str, str]] = []
    warm = _samples(args.seed * 100 + 99, min(WARMUP_SAMPLES, args.samples), records)
    warm_batch = _batches(args.seed * 100 + 98, args.batch, 1, records)
    steps = per_sample_plan(args, podagents, records)
    dataset = out / "per-sample-dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in records))
    servers: dict[str, Server] = {}
    cpus = os.cpu_count() or 1
    load_before = os.getloadavg()
    print(f"\nper-sample load (openrlhf-m): {args.samples} samples per run, {args.in_flight} in "
          f"flight from {args.sample_clients} client process(es) running {client}; batched: "
          f"{args.batch} per request from 1 and {CLIENTS} clients; {args.rounds} rounds; "
          f"{args.workers} workers per podagent server", flush=True)
    try:
        start_servers(args, podagents, dataset, out, warm[0], servers)
        for name, server in servers.items():  # warm-up, not timed
            url = f"{server.url}/get_reward"
            run_load(Job("per-sample", url, warm, in_flight=args.in_flight,
                         upstream=args.openrlhf), server.proc.pid, out, f"warm-{name}")
            if name in podagents and not args.no_batched:
                run_load(Job("batched", url, warm_batch), server.proc.pid, out, f"warm-{name}")
        rows = run_steps(steps, servers, args, out, labels)
        counters = {}
        for name in podagents:
            health = servers[name].session.get(f"{servers[name].url}/health", timeout=10).json()
            counters[name] = {k: health[k] for k in (
                "items", "fast_path", "cache_hits", "deduped", "verified", "timeouts",
                "gold_parses", "quirks", "batches")}
    finally:
        exit_codes = {name: server.stop() for name, server in servers.items()}
    load_after = os.getloadavg()
    ordered = [rows[mode, name] for mode in PER_SAMPLE_MODES for name in servers
               if (mode, name) in rows]
    ceiling = rows.get(("per-sample", CEILING))
    table_rows = [load_row(row, labels[row.server], cpus, ceiling) for row in ordered]
    notes = [
        f"- client: {client}, one process, {args.in_flight} samples in flight, a new "
        f"connection per request; {args.rounds} rounds, each with new samples shared by every "
        f"server, the order of the runs reversed every other round; 'first' is the first "
        f"{args.samples:,} samples after a warm-up of {len(warm)}, 'worst' and 'best' the "
        f"slowest and fastest rounds, 'of ceiling' a round's rate over the ceiling's in that "
        f"round.",
        f"- CPU: the client's share is CPU s / (wall s x {cpus} CPUs) in its best round; a "
        f"server's CPU per sample is that of the process and its children (median round).",
        f"- {args.workers} verifier processes per podagent server; seed {args.seed}; load "
        f"average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
        *goal_notes(rows, podagents, labels, args),
        *reward_checks(rows, podagents, labels, args),
        f"- podagent counters (warm-up included): {json.dumps(counters)}; exit codes after "
        f"SIGTERM: {json.dumps(exit_codes)}.",
    ]
    write_report(out, "per-sample", render_load, table_rows, notes, {
        "rows": table_rows, "args": {k: v for k, v in vars(args).items() if k != "scoring"},
        "client": client, "cpus": cpus, "load_before": load_before, "load_after": load_after,
        "counters": counters, "exit_codes": exit_codes, "notes": notes,
        "runs": [{"mode": r.mode, "server": labels[r.server], "loads": [
            {"wall_s": x.wall_s, "client_cpu_s": x.client_cpu_s,
             "server_cpu_s": x.server_cpu_s, "latencies": x.latencies, "retries": x.retries,
             "failures": x.failures} for x in r.loads]} for r in ordered]})


def write_report(out: Path, stem: str, layout: Callable[[list[dict[str, Any]], bool], str],
                 rows: list[dict[str, Any]], notes: list[str], results: dict[str, Any]) -> None:
    """A table on screen twice (aligned to read, then markdown with its notes to paste) and in
    out/<stem>.md; its figures in out/<stem>.json."""
    print()
    print(layout(rows, False))
    print()
    markdown = layout(rows, True) + "\n\n" + "\n".join(notes)
    print(markdown)
    (out / f"{stem}.md").write_text(markdown + "\n")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")


def run(args: argparse.Namespace) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) / f"reward-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"results in {out}", flush=True)
    if not args.per_sample_only:
        run_batched(args, out)
    if "openrlhf-m" in args.scoring:
        run_per_sample(args, out)
    return 0


def run_batched(args: argparse.Namespace, out: Path) -> None:
    """The older table: batches of 1, 64 and 256 sent one at a time, every profile."""
    counts = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    load_before = os.getloadavg()
    print(f"workers {args.workers} each; load average {load_before[0]:.2f} (1 min)", flush=True)
    profiles = [run_profile(name, args, counts, out) for name in args.scoring]
    rows = [row for p in profiles for row in table(p.name, p.servers, BATCHES)]
    load_after = os.getloadavg()
    notes = [
        f"- {args.workers} verifier processes each; seed {args.seed}; "
        f"{'quick' if args.quick else 'full'} run; requests sent one at a time.",
        f"- load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after, on "
        f"{os.cpu_count()} CPUs.",
    ]
    for p in profiles:
        notes += [
            f"- {p.name}: rewards that differ between the servers: {p.disagreements} of "
            f"{p.items} items; built-in server counters (warm-up included): "
            f"{json.dumps(p.counters)}; exit codes after SIGTERM: {json.dumps(p.exit_codes)}.",
        ]
    write_report(out, "results", render, rows, notes, {
        "rows": rows, "workers": args.workers, "seed": args.seed, "quick": args.quick,
        "load_before": load_before, "load_after": load_after,
        "profiles": {p.name: {"disagreements": p.disagreements, "items": p.items,
                              "counters": p.counters, "exit_codes": p.exit_codes,
                              "latencies": {s.name: s.latencies for s in p.servers}}
                     for p in profiles}})


def _profiles(raw: str) -> list[str]:
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if not names or any(n not in SCORING for n in names):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of {', '.join(SCORING)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests per batch size")
    parser.add_argument("--workers", type=int, default=cpu_count(),
                        help="verifier processes per server (default: CPUs)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed")
    parser.add_argument("--scoring", type=_profiles, default=list(SCORING),
                        help="profiles to run, comma-separated (default: openrlhf-m,boxed)")
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"),
                        help="results directory (git-ignored)")
    load = parser.add_argument_group(
        "per-sample load (openrlhf-m; runs after the batched table, or alone)")
    load.add_argument("--per-sample-only", action="store_true",
                      help="skip the older batched table")
    load.add_argument("--samples", type=int,
                      help=f"samples per run (default {PER_SAMPLE}; quick {QUICK_PER_SAMPLE})")
    load.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                      help=f"per-sample requests outstanding at once (default {IN_FLIGHT})")
    load.add_argument("--sample-clients", type=int, default=1,
                      help="client processes sharing the per-sample load (one is capped by its "
                           "own CPU near 1,700 requests/s; default 1)")
    load.add_argument("--batch", type=int,
                      help=f"items per batched request (default {BATCH}; quick {QUICK_BATCH})")
    load.add_argument("--rounds", type=int, default=ROUNDS,
                      help=f"rounds of every run: first, worst, best shown (default {ROUNDS})")
    load.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                      help="an argument for a second podagent server that gets the same loads "
                           "(repeat for several: --server-arg=--item-timeout=10)")
    load.add_argument("--before", metavar="DIR",
                      help="a checkout of an earlier podagent: its server gets every podagent "
                           "load too, a row each (before and after in one run)")
    load.add_argument("--before-label", help="what to call --before in the table")
    load.add_argument("--no-batched", action="store_true",
                      help="per-sample rows only (no batched rows)")
    load.add_argument("--openrlhf", metavar="DIR",
                      help="a checkout of upstream OpenRLHF: its own client code sends the "
                           "per-sample load (default: a client of the same shape)")
    load.add_argument("--openrlhf-m", metavar="DIR",
                      help="a checkout of OpenRLHF-M: its own reward server is the baseline "
                           "(default: one written its way); needs flask, Levenshtein, loguru")
    parser.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.samples is None:
        args.samples = QUICK_PER_SAMPLE if args.quick else PER_SAMPLE
    if args.batch is None:
        args.batch = QUICK_BATCH if args.quick else BATCH
    if args.serve_baseline:
        serve_baseline("127.0.0.1", args.port, args.workers, args.scoring[0], args.dataset)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
