"""Reward server benchmark: podagent's built-in server vs. a Flask + process-pool baseline,
for each scoring profile.

For each profile (--scoring, default both), podagent's server and a baseline server that
scores by the same rule run as real processes on loopback, each on a free port, with the same
number of verifier processes (--workers, default: this machine's CPUs), and get the same
requests in alternation, so machine noise falls on both alike. Run from the repository root:

    python bench/reward.py --quick        # a smoke check: a few requests per batch size
    python bench/reward.py                # the full run (several minutes on 2 cores)

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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import requests  # noqa: E402
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed  # noqa: E402

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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(name: str, argv: list[str], port: int, log: Path,
          probe: dict[str, list[str]]) -> Server:
    """The server, once it answers `probe` (one item of the workload) with one reward."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO)
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


def run(args: argparse.Namespace) -> int:
    counts = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) / f"reward-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    print(f"workers {args.workers} each; load average {load_before[0]:.2f} (1 min); "
          f"results in {out}", flush=True)
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
    print()
    print(render(rows, markdown=False))
    print()
    markdown = render(rows, markdown=True) + "\n\n" + "\n".join(notes)
    print(markdown)
    (out / "results.md").write_text(markdown + "\n")
    (out / "results.json").write_text(json.dumps({
        "rows": rows, "workers": args.workers, "seed": args.seed, "quick": args.quick,
        "load_before": load_before, "load_after": load_after,
        "profiles": {p.name: {"disagreements": p.disagreements, "items": p.items,
                              "counters": p.counters, "exit_codes": p.exit_codes,
                              "latencies": {s.name: s.latencies for s in p.servers}}
                     for p in profiles}}, indent=1) + "\n")
    return 0


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
    parser.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_baseline:
        serve_baseline("127.0.0.1", args.port, args.workers, args.scoring[0], args.dataset)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
